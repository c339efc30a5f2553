"""``"tiered": {"auto_config": {...}}``: the fastest config that fits, chosen for the user.

[Note: auto config]
A config may leave the memory layout to the planner:

    "tiered": {"auto_config": {"cpu_mem": "64GB", "gpu_mem": "80GB", "nvme_mem": "4TB",
                               "activation_mem": "6GB", "bandwidth": "bench.json"}}

(each key optional; a memory left out is not checked, ``bandwidth`` is `tiered bench --json`
output). `tiered.initialize` and `tiered finetune` (``--auto-config cpu_mem=64GB,gpu_mem=80GB``)
resolve it before the config is read. The rest of the config is validated first, by the config
loader, exactly as without ``auto_config`` (a bad value is the ConfigError naming its key,
before the planner reads anything), and it is the search's base ([Note: config search]): every
knob it writes itself (a value, not null or "auto": `tiered.config.fields.written_fields`) is
pinned at its resolved value and kept as written (offload devices, ``sub_group_size``,
``offload_optimizer.buffer_count``, ``offload_param.max_in_cpu``,
``stage3_param_persistence_threshold``, ``stage3_max_live_parameters``, ``tiered.grad_tier``,
``tiered.overlap_step_with_backward``), the search runs over the model being trained (its real
module tree), and the chosen knobs and tier budgets are written into the config, which is then
read as if the user had written them. NVMe placements are weighed only where the config names an
``nvme_path``. What was chosen is logged at INFO. `tiered finetune` fills ``activation_mem``,
where the config leaves it out, with [Note: activation estimate] for its micro-batch, sequence
length and precision (a run's activations need their room as much as its state does). A config
with tiers of its own (``tiered.tiers``) is refused: the budgets are what the planner chooses. A
memory given beyond what this machine has (host memory, the GPU's, the disk under nvme_path) is
refused naming that memory as the user gave it (``tiered.auto_config.cpu_mem``, or ``--auto-config
cpu_mem`` from the command line), never the tier budget derived from it; when nothing fits,
CapacityError names the memories given, the closest config and every memory it is short of,
each with the keys that would fix it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from tiered.config.auto_request import CONFIG_SPELLING, AutoRequest, split_auto_config
from tiered.config.fields import TIERS_FIELD
from tiered.config.schema import TieredConfig
from tiered.device import Device, default_device
from tiered.errors import CapacityError, ConfigError
from tiered.planning.candidate import Base
from tiered.planning.search import Memories, search, shortfall_text
from tiered.planning.timing import DEFAULT_BANDWIDTH, read_bandwidth
from tiered.units import format_bytes

log = logging.getLogger(__name__)


def _machine_has(key: str, base: Base) -> tuple[int | None, str]:
    """What this machine has of the memory `key` names, in all (None: cannot tell), in words."""
    if key == "cpu_mem":
        return Device("cpu").mem_info()[1], "this machine's host memory"
    if key == "gpu_mem":  # the gpu tier's memory: the GPU's, or host memory on a CPU-only machine
        device = default_device()
        return device.mem_info()[1], "the GPU's memory" if device.is_cuda else "host memory (no GPU here)"
    path = base.nvme_path
    if key != "nvme_mem" or path is None:
        return None, ""
    try:
        st = os.statvfs(os.path.expanduser(path))
    except OSError:
        return None, ""
    return st.f_blocks * st.f_frsize, f"the disk under {path!r}"


def _check_given(request: AutoRequest, base: Base) -> None:
    """A memory given beyond what the machine has is refused by its own name ([Note: auto config])."""
    for key in ("cpu_mem", "gpu_mem", "nvme_mem"):
        given = request.memories[key]
        has, where = _machine_has(key, base)
        if given is not None and has is not None and given > has:
            raise CapacityError(
                f"{request.name(key)} {format_bytes(given, binary=True)} is more than {where} has in all "
                f"({format_bytes(has, binary=True)}); give at most that"
            )


def resolve_auto_config(
    config: dict[str, Any],
    model: nn.Module,
    *,
    world_size: int = 1,
    spelled: str = CONFIG_SPELLING,
    activations: Callable[[TieredConfig], int] | None = None,
) -> dict[str, Any]:
    """`config` with ``tiered.auto_config`` replaced by the chosen knobs ([Note: auto config]).
    `spelled` prefixes each auto_config key in errors; `activations` gives ``activation_mem``
    from the validated config where auto_config leaves it out."""
    request, raw = split_auto_config(config, spelled)
    base = Base.read(raw, model, world_size=world_size)  # the user's keys validated before any is read
    if TIERS_FIELD in base.written:
        raise ConfigError(
            f"{spelled.strip().rstrip('.')} chooses the tier budgets itself, but tiered.tiers is set too; "
            "remove one"
        )
    _check_given(request, base)
    given = request.memories
    act = given["activation_mem"]
    if act is None and activations is not None:
        act = activations(base.cfg)
    mem = Memories(given["gpu_mem"], given["cpu_mem"], given["nvme_mem"], act)
    bw = dict(DEFAULT_BANDWIDTH) if request.bandwidth is None else read_bandwidth(request.bandwidth)[0]
    result = search(
        model,
        mem,
        base=base,
        nvme_path=base.nvme_path,
        world_size=world_size,
        bandwidth=bw,
        device_kind="cuda" if default_device().is_cuda else "cpu",  # the process that will run it
    )
    best = result.best
    if best is None:
        raise CapacityError(_nothing_fits(request, mem, base, result))
    log.info(
        "tiered.auto_config chose %s (peaks: GPU %s, host %s, NVMe %s; predicted %.3g s/step)",
        best.knobs,
        format_bytes(best.peaks["device"], binary=True),
        format_bytes(best.peaks["host"], binary=True),
        format_bytes(best.peaks["disk"], binary=True),
        best.seconds_per_step,
    )
    return best.config


def _nothing_fits(request: AutoRequest, mem: Memories, base: Base, result: Any) -> str:
    """The refusal: the memories as the user gave them, the closest config and what it lacks."""
    near = result.closest
    detail = shortfall_text(near) if near is not None else "no config could be counted"
    knobs = "" if near is None else f"closest: {near.knobs}; "
    memories = ", ".join(
        f"{request.name(k)} {format_bytes(v, binary=True)}"
        for k, v in request.memories.items()
        if v is not None
    )
    if mem.activations:
        detail += (
            f"; the activations take {format_bytes(mem.activations, binary=True)} of the memory given "
            f"({request.name('activation_mem')}; tiered finetune estimates it from --batch-size, --seq-len "
            "and --gradient-checkpointing)"
        )
    if base.nvme_path is None:
        detail += (
            "; NVMe placements were not weighed: the config names no nvme_path (set "
            "zero_optimization.offload_optimizer.nvme_path to a folder on an NVMe drive)"
        )
    return f"nothing fits the memory given ({memories}): {knobs}{detail}"
