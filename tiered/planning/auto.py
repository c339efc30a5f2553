"""``"tiered": {"auto_config": {...}}``: the fastest config that fits, chosen for the user.

[Note: auto config]
A config may leave the memory layout to the planner:

    "tiered": {"auto_config": {"cpu_mem": "64GB", "gpu_mem": "80GB", "nvme_mem": "4TB",
                               "activation_mem": "6GB", "bandwidth": "bench.json"}}

(each key optional; a memory left out is not checked, ``bandwidth`` is `tiered bench --json`
output). `tiered.initialize` and `tiered finetune` (``--auto-config cpu_mem=64GB,gpu_mem=80GB``)
resolve it before the config is read: the search of [Note: config search] runs over the model
being trained (its real module tree), every knob the config sets itself is pinned (offload
devices, ``sub_group_size``, ``offload_optimizer.buffer_count``, ``offload_param.max_in_cpu``,
``stage3_param_persistence_threshold``, ``tiered.grad_tier``), and the chosen knobs and tier
budgets are written into the config, which is then read as if the user had written them. What
was chosen is logged at INFO. `tiered finetune` fills ``activation_mem``, where the config leaves it
out, with [Note: activation estimate] for its micro-batch and sequence length (a run's
activations need their room as much as its state does). A config with tiers of its own (``tiered.tiers``) is refused: the
budgets are what the planner chooses. When nothing fits, CapacityError names the closest
config and every memory it is short of, each with the keys that would fix it.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from torch import nn

from tiered.device import default_device
from tiered.errors import CapacityError, ConfigError
from tiered.planning.search import Memories, Pinned, search, shortfall_text
from tiered.planning.timing import DEFAULT_BANDWIDTH, read_bandwidth
from tiered.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

AUTO_KEYS = ("cpu_mem", "gpu_mem", "nvme_mem", "activation_mem", "bandwidth")


def has_auto_config(config: Any) -> bool:
    return (
        isinstance(config, dict)
        and isinstance(config.get("tiered"), dict)
        and "auto_config" in config["tiered"]
    )


def _pins(config: dict[str, Any]) -> dict[str, Any]:
    z = config.get("zero_optimization") or {}
    pins: dict[str, Any] = {}
    for section, knob in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        dev = (z.get(section) or {}).get("device")
        if dev is not None:
            pins[knob] = dev
    if z.get("sub_group_size") is not None:
        pins["sub_group_size"] = int(float(z["sub_group_size"]))
    if (z.get("offload_optimizer") or {}).get("buffer_count") is not None:
        pins["buffer_count"] = int(z["offload_optimizer"]["buffer_count"])
    if (z.get("offload_param") or {}).get("max_in_cpu") is not None:
        pins["max_in_cpu"] = int(float(z["offload_param"]["max_in_cpu"]))
    if z.get("stage3_param_persistence_threshold") is not None:
        pins["persistence_threshold"] = int(float(z["stage3_param_persistence_threshold"]))
    grad = (config.get("tiered") or {}).get("grad_tier")
    if grad is not None:
        pins["grad_tier"] = grad
    return pins


def _nvme_path(config: dict[str, Any]) -> str:
    z = config.get("zero_optimization") or {}
    for section in ("offload_optimizer", "offload_param"):
        path = (z.get(section) or {}).get("nvme_path")
        if path is not None:
            return str(path)
    return "./tiered_offload"


def raw_precision(raw: dict[str, Any]) -> str:
    """ "bf16", "fp16" or "fp32": what a raw config's sections enable, before it is read."""
    return next((p for p in ("bf16", "fp16") if (raw.get(p) or {}).get("enabled") is True), "fp32")


def resolve_auto_config(config: dict[str, Any], model: nn.Module, *, world_size: int = 1) -> dict[str, Any]:
    """`config` with ``tiered.auto_config`` replaced by the chosen knobs ([Note: auto config])."""
    raw = copy.deepcopy(config)
    tiered = raw["tiered"]
    auto = tiered.pop("auto_config")
    if not isinstance(auto, dict):
        raise ConfigError(f"tiered.auto_config: expected a JSON object {{...}}, got {auto!r}")
    unknown = sorted(set(auto) - set(AUTO_KEYS))
    if unknown:
        raise ConfigError(
            f"tiered.auto_config: unknown key {', '.join(unknown)}; keys: {', '.join(AUTO_KEYS)}"
        )
    if tiered.get("tiers"):
        raise ConfigError(
            "tiered.auto_config chooses the tier budgets itself, but tiered.tiers is set too; remove one"
        )

    def size(key: str) -> int | None:
        v = auto.get(key)
        return None if v is None else parse_bytes(v, what=f"tiered.auto_config.{key}")

    mem = Memories(size("gpu_mem"), size("cpu_mem"), size("nvme_mem"), size("activation_mem"))
    bw = (
        dict(DEFAULT_BANDWIDTH)
        if auto.get("bandwidth") is None
        else read_bandwidth(str(auto["bandwidth"]))[0]
    )
    precision = raw_precision(raw)
    gas = raw.get("gradient_accumulation_steps")
    result = search(
        model,
        mem,
        Pinned(_pins(raw)),
        precision=precision,
        accumulation=gas if isinstance(gas, int) else 1,
        world_size=world_size,
        nvme_path=_nvme_path(raw),
        bandwidth=bw,
        base=raw,
        device_kind="cuda" if default_device().is_cuda else "cpu",  # the process that will run it
    )
    best = result.best
    if best is None:
        near = result.closest
        detail = shortfall_text(near) if near is not None else "no config could be counted"
        knobs = "" if near is None else f"closest: {near.knobs}; "
        given = ", ".join(
            f"{k} {format_bytes(v, binary=True) if k.endswith('_mem') and (v := size(k)) is not None else auto[k]}"
            for k in auto
        )
        if mem.activations:
            detail += (
                f"; the activations take {format_bytes(mem.activations, binary=True)} of the memory given "
                "(tiered.auto_config.activation_mem; tiered finetune estimates it from --batch-size, "
                "--seq-len and --gradient-checkpointing)"
            )
        raise CapacityError(f"tiered.auto_config: nothing fits {given}: {knobs}{detail}")
    raw = best.config
    log.info(
        "tiered.auto_config chose %s (peaks: GPU %s, host %s, NVMe %s; predicted %.3g s/step)",
        best.knobs,
        format_bytes(best.peaks["device"], binary=True),
        format_bytes(best.peaks["host"], binary=True),
        format_bytes(best.peaks["disk"], binary=True),
        best.seconds_per_step,
    )
    return raw
