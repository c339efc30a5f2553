"""Fit, then fastest: the configs `tiered plan` and ``"auto_config"`` weigh, each checked by
the engine's own memory model, ranked by the predicted seconds per step.

[Note: config search]
The knobs searched are the ones that change what a run needs or moves: where the optimizer
state, the parameters and the gradients live (``offload_optimizer.device``,
``offload_param.device``, ``tiered.grad_tier``), ``sub_group_size`` (group splits and the
optimizer pipeline's tile), ``offload_optimizer.buffer_count`` (pipeline depth) and
``stage3_param_persistence_threshold`` (small parameters kept on the GPU). ``offload_param.max_in_cpu``
is not a grid: it is set to the parameter elements the cpu budget has room for once the run's
need is met (their dirty copies save the NVMe reads of [Note: max_in_cpu]); the parameter buffers
of DeepSpeed (``offload_param.buffer_count/buffer_size``) are not searched because the engine
stages parameters in the cpu tier, whose budget already bounds them. Each candidate is its
knobs laid onto a base config (the user's own for ``auto_config``, else only the precision and
the accumulation steps: `tiered.planning.candidate`) through tiered.config's fields ([Note: a raw
config by field]), so every key is spelled and every default given by its declaration; it is
resolved by the config loader and predicted by `tiered.planning.needs.predict` (the engine's
pre-flight arithmetic): it fits when every tier's need is within its budget and the host's
total ([Note: one memory model]) within ``cpu_mem``. A knob searched takes each value of its
grid, a pinned one only its own (on the grid or not); the NVMe placements are weighed only
where an ``nvme_path`` is known (``--nvme-path``, or the user's config): the planner never
invents a folder.
Budgets are what the user gave: the gpu tier gets ``gpu_mem`` less the declared activations, the
cpu tier ``cpu_mem`` less the process baseline (of the device kind the run will have: "cuda"
unless told), what the engine holds outside the tiers and the backends' own buffers, never more.
Fitting configs are ranked by predicted s/step ([Note: step time model] in timing.py). A knob
the user pins is never varied, and a key the base config writes is never changed; pinned knobs
that contradict each other (a grad tier on NVMe with the optimizer on the GPU, say) are refused
by name, the flag's or the config key's. ``tiered.overlap_step_with_backward`` is
set where gradients are homed on disk and it applies (`overlap_applies`): the step then takes
each gradient from memory, the same values, without the disk round trip of [Note: bytes per
step]; a value the user wrote is kept.

[Note: the live budget searched]
What the gpu tier keeps between a group's forward and its backward is decided by
``stage3_max_live_parameters`` (and ``stage3_max_reuse_distance``, [Note: the live budget]); a
group it cannot keep the backward reads again (`backward_rereads`). So the budget is a searched
knob, weighed at two values per placement: the default (`live_parameters`: the declared one,
DeepSpeed's 1e9, or twice the largest module where that is more) and the largest the GPU has room for: the gpu
budget less the gpu tier's need (homes, persistent groups, the largest module's gather, the
optimizer's gpu staging) less the gather's bytes once more (the largest module's gradient,
made on the device before it is reduced), at most every gathered element. The reuse distance
is written as twice the live budget: a group's forward-to-backward distance counts the rest of
the forward and the backward up to it, up to twice the model, and the live budget alone then
decides what is evicted (furthest next use first). The gpu tier's need counts only the largest
module's gather, so the live bytes beyond it (`tiered.planning.needs.live_extra_bytes`) are
added on top, by the search to the GPU peak and by the engine's pre-flight to what the gpu
budget must hold (`live_budget_shortfall`: for a value the config sets, a refusal naming the
key and the largest value that fits; DeepSpeed's default stays a cap enforced by eviction): a
recommended budget is one the gpu tier holds, and the re-reads the plan predicts are
the ones the engine's rules make. A user's value (``--max-live-parameters``, or
the base config's) is the only one weighed. The larger budget is weighed only where the
activations' memory is known (``--activation-mem``, or estimated from ``--seq-len`` and
``--micro-batch``): otherwise that room may be theirs (a 36B Llama at 4096 tokens needs ~13 GB
even checkpointed), and filling it with parameters would trade re-reads for an out-of-memory.
Where the default does not fit the GPU, the largest that does is weighed in any case (downward:
a 0.55B model's default budget, the whole model, is more than a 512 MiB GPU holds, and a
smaller one re-reads what it cannot keep). For the same reason such a config says ``tiered.residency: "host"``: the gpu budget it writes
(the whole GPU, the activations not being known) holds no more groups persistent than the
threshold makes ([Note: persistent by room] in tiered/zero/layout.py); the cpu tier still keeps
what its budget has room for.

[Note: a cpu tier caches up to its budget]
The tier manager keeps a clean copy in memory of a partition homed on disk (a gradient, an
optimizer state read for the step) for as long as the tier's budget has room, evicting only
under pressure: a read it saves the next time. So where anything is homed on disk the cpu tier
fills towards its budget, not only to its need: measured, the cpu tier peaked at 1.27-1.48x its
need on the optimizer-on-NVMe rows of benchmarks/plan_vs_measured.py (issue 21). The host figure
of such a config therefore counts the cpu tier at its budget (with ``offload_param.max_in_cpu``
that room is already the kept parameters'); the budget is what ``cpu_mem`` leaves after the rest
of the host figure, so the figure is then ``cpu_mem`` itself.

[Note: compute memory on a CPU-only machine]
Forward and backward keep their activations and autograd temporaries where the compute runs:
device memory on a GPU, host memory on a machine without one (device kind "cpu", where the "gpu"
tier is a budgeted region of host memory too). So with ``device_kind="cpu"`` the activations
(``Memories.activations``: ``--activation-mem``, or [Note: activation estimate] from the batch,
with an MoE's per-shape kernels: [Note: per-shape kernels of a CPU MoE])
are not taken off the gpu tier's budget but added to the host figure, and the cpu tier's budget
is what is left of ``cpu_mem`` after them. The compute's own runtime (the code pages and thread
pools a first forward/backward brings in, ~22 MiB with torch 2.13+cpu) is in the "cpu" process
baseline ([Note: one memory model], measured by benchmarks/host_baseline.py with one small step).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiered.config.loader import load_config
from tiered.errors import CapacityError, ConfigError
from tiered.planning.candidate import KNOB_FIELDS, Base, candidate_config, overlap_applies, plan_base
from tiered.planning.gpu_room import fill_gpu_room
from tiered.planning.needs import Prediction, live_extra_bytes, predict
from tiered.planning.pinned import NOTHING_PINNED, Pinned, config_name
from tiered.planning.residency import Residency, TierRoom, config_residency
from tiered.planning.timing import DEFAULT_BANDWIDTH, config_seconds_per_step, training_flops
from tiered.units import format_bytes

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
    from tiered.shards import ShardGroup
    from tiered.zero.layout import GroupLayout

SUB_GROUP_SIZES = (1_000_000_000, 200_000_000, 100_000_000, 50_000_000, 20_000_000, 10_000_000, 5_000_000)
BUFFER_COUNTS = (4, 2, 1)
PERSISTENCE_THRESHOLDS = (100_000, 0)
GRID = {
    "sub_group_size": SUB_GROUP_SIZES,
    "buffer_count": BUFFER_COUNTS,
    "persistence_threshold": PERSISTENCE_THRESHOLDS,
}
"""The searched values of the knobs `knob_grid` enumerates beside the placement."""
PLACEMENTS = (  # (optimizer device, parameter device, grad tier): cheapest first
    ("none", "none", "gpu"),
    ("cpu", "none", "cpu"),
    ("cpu", "cpu", "cpu"),
    ("nvme", "none", "cpu"),
    ("nvme", "cpu", "cpu"),
    ("nvme", "nvme", "cpu"),
    ("cpu", "nvme", "cpu"),
    ("nvme", "nvme", "nvme"),
    ("cpu", "cpu", "nvme"),
    ("nvme", "cpu", "nvme"),
)
PLACEMENT_KNOBS = ("offload_optimizer", "offload_param", "grad_tier")
KNOBS = tuple(KNOB_FIELDS)
"""The knobs a user may pin (`Pinned`), by the names the plan's flags and errors use."""


@dataclass(frozen=True)
class Memories:
    """What the user said each memory has per rank (None: not given, not checked)."""

    gpu: int | None = None
    cpu: int | None = None
    nvme: int | None = None
    activations: int | None = None
    """Memory the activations need (`--activation-mem`, or estimated from the batch): the GPU's,
    or host memory's on a CPU-only machine ([Note: compute memory on a CPU-only machine]). None:
    not known, so the search leaves the GPU's room beyond ZeRO-3's working set to them: the live
    budget stays at its default ([Note: the live budget searched])."""


def activations_on(mem: Memories, device_kind: str, memory: str) -> int:
    """The activations' bytes `memory` ("device" or "host") holds: the GPU's on a CUDA machine,
    host memory's where the compute runs on the CPU ([Note: compute memory on a CPU-only machine])."""
    where = "host" if device_kind == "cpu" else "device"
    return (mem.activations or 0) if memory == where else 0


@dataclass(frozen=True)
class Candidate:
    """One config weighed: its knobs, the config, the prediction and the verdict."""

    knobs: dict[str, Any]
    config: dict[str, Any]
    prediction: Prediction | None
    shortfalls: dict[str, int]
    """memory ("device", "host", "disk") -> bytes short; empty when it fits."""
    refused: str = ""
    """Why the engine would refuse it before any byte is counted (a module that cannot be gathered)."""
    peaks: dict[str, int] = field(default_factory=dict)
    traffic: dict[str, int] = field(default_factory=dict)
    seconds_per_step: float = float("inf")

    @property
    def fits(self) -> bool:
        return not self.shortfalls and not self.refused

    @property
    def placement(self) -> tuple[str, str, str]:
        """(optimizer device, parameter device, grad tier)."""
        return (self.knobs["offload_optimizer"], self.knobs["offload_param"], self.knobs["grad_tier"])


@dataclass(frozen=True)
class Setup:
    """What every candidate of one search shares ([Note: config search]): the model, the
    memories given, the base config, the machine, and the layout cache."""

    model: nn.Module
    mem: Memories
    base: Base = field(default_factory=plan_base)
    nvme_path: str | None = None
    """Where NVMe placements write (None: they are not weighed)."""
    world_size: int = 1
    bandwidth: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    device_kind: str = "cuda"
    """The machine that will run it ("cuda", "cpu"): the process baseline's ([Note: one memory model])."""
    compute_flops: float = 0.0
    """The training FLOPs of a step ([Note: step time model])."""
    checkpointing: bool = False
    max_in_cpu: int | None = None
    """``offload_param.max_in_cpu`` pinned (None: sized from the cpu budget's room)."""
    layouts: dict[tuple[object, ...], tuple[GroupLayout, list[ShardGroup]]] = field(default_factory=dict)


def knob_grid(pinned: Pinned, *, nvme: bool = True) -> Iterable[dict[str, Any]]:
    """Every combination of the searched knobs with the pinned ones fixed; without `nvme` (no
    nvme_path known) no placement that writes to NVMe."""
    pinned.check()

    def values(knob: str) -> tuple[Any, ...]:
        return GRID[knob] if pinned.get(knob) is None else (pinned.get(knob),)

    prefetch = pinned.get("prefetch_bucket_size")
    for placement in PLACEMENTS:
        if any(pinned.get(k) not in (None, p) for k, p in zip(PLACEMENT_KNOBS, placement, strict=True)):
            continue
        if "nvme" in placement and not nvme:
            continue
        counts = values("buffer_count")[:1] if placement[0] == "none" else values("buffer_count")
        for sgs, bc, thr in itertools.product(
            values("sub_group_size"), counts, values("persistence_threshold")
        ):
            # no pipeline without an offloaded optimizer: buffer_count changes nothing there
            yield {
                **dict(zip(PLACEMENT_KNOBS, placement, strict=True)),
                "sub_group_size": sgs,
                "buffer_count": bc,
                "persistence_threshold": thr,
                "max_in_cpu": None,
                **({} if prefetch is None else {"prefetch_bucket_size": prefetch}),
            }


def live_parameters(model: nn.Module, default: int) -> int | None:
    """``stage3_max_live_parameters`` when the `default` (DeepSpeed's 1e9) cannot hold the
    largest module and the one prefetched after it (a 128k vocabulary's embedding at hidden 8192
    is 1.05e9): twice the largest module's own parameters; None keeps the default."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return 2 * largest if 2 * largest > default else None


def weigh(
    model: nn.Module, knobs: dict[str, Any], mem: Memories, *, max_live: int | None = None, **setup: Any
) -> Candidate:
    """One placement and its knobs ([Note: config search]); `setup` the fields of `Setup`."""
    return _weigh(Setup(model, mem, **setup), knobs, max_live)


def _weigh(s: Setup, knobs: dict[str, Any], max_live: int | None) -> Candidate:
    """One placement and its knobs, at the live budgets [Note: the live budget searched] weighs:
    the default (`live_parameters`) and the largest the GPU has room for; the faster that fits
    (a value the user pinned, `max_live`, is the only one weighed)."""
    if max_live is not None:
        return _weigh_at(s, knobs, max_live)
    mem, ws = s.mem, s.world_size
    first = _weigh_at(s, knobs, live_parameters(s.model, s.base.default("max_live_parameters")))
    pred = first.prediction
    if pred is None or mem.gpu is None or (ws == 1 and knobs["offload_param"] == "none"):
        return first  # nothing gathered: the parameters are the GPU's own
    if mem.activations is None and first.fits:
        return first  # the room may be the activations': not filled with parameters unasked
    gpu_budget = max(0, mem.gpu - activations_on(mem, s.device_kind, "device"))
    itemsize = pred.placement.compute_dtype.itemsize
    per_element = itemsize * ((1 + 1 / ws) if ws > 1 else 1)  # as `live_gpu_bytes`
    gather = pred.needs["gpu"]["gather"] if "gpu" in pred.needs else 0
    room = gpu_budget - pred.tier_bytes("device")  # the gather's bytes again: the largest module's gradient
    total = sum(g.full_numel for g in pred.groups if not g.persistent and (g.param.home != "gpu" or ws > 1))
    fit = min(total, int(room // per_element))
    if fit * per_element < gather:
        return first  # too little room: the default or nothing
    if mem.activations is None and fit >= (first.knobs.get("max_live_parameters") or 0):
        return first  # only downward where the activations' room is not known: below the default
    second = _weigh_at(s, knobs, int(fit))
    # ties (another link bounds the step): fewer bytes moved, the re-reads' PCIe time saved
    return min(
        (first, second),
        key=lambda c: (
            not c.fits,
            round(c.seconds_per_step, 6),
            sum(c.traffic.values()),
            c.peaks.get("device", 0),
        ),
    )


def _weigh_at(s: Setup, knobs: dict[str, Any], live: int | None) -> Candidate:
    """One config: predicted by the engine's memory model, fit-checked, timed ([Note: config
    search]); `live` the live budget written (None: the base's own)."""
    mem, base = s.mem, s.base
    gpu_budget = None if mem.gpu is None else max(0, mem.gpu - activations_on(mem, s.device_kind, "device"))
    on_host = activations_on(mem, s.device_kind, "host")  # [Note: compute memory on a CPU-only machine]
    knobs = {**knobs, "max_live_parameters": live, "overlap_step": overlap_applies(knobs, base)}
    if mem.gpu is not None and mem.activations is None and s.device_kind != "cpu":
        knobs["residency"] = "host"  # [Note: the live budget searched]: the GPU's room may be theirs
    budgets: dict[str, int | None] = {"gpu": gpu_budget, "cpu": mem.cpu, "nvme": mem.nvme}
    config = candidate_config(knobs, base, nvme_path=s.nvme_path, budgets=budgets)
    try:
        cfg = load_config(config, model=s.model, world_size=s.world_size)
        # without residency: the need first; what the cpu tier keeps is weighed at the budget written
        pred = predict(
            s.model,
            cfg,
            world_size=s.world_size,
            device_kind=s.device_kind,
            gpu_is_host=s.device_kind == "cpu",  # [Note: compute memory on a CPU-only machine]
            layouts=s.layouts,
            rooms={},
        )
    except (CapacityError, ConfigError) as exc:
        return Candidate(knobs, config, None, {}, refused=str(exc))
    # the cpu tier's budget: what host memory has left after the rest of the host figure (on a
    # machine without a GPU the "gpu" tier is host memory too)
    other_host = sum(
        int(d["total"]) for t, d in pred.needs.items() if t != "cpu" and pred.memory.get(t) == "host"
    )
    cpu_budget = None if mem.cpu is None else max(0, mem.cpu - pred.host_extra_bytes - on_host - other_host)
    peaks = {m: pred.peak_bytes(m) for m in ("device", "host", "disk")}
    peaks["host"] += on_host
    if pred.memory.get("gpu") == "device":  # [Note: the live budget searched]: held beyond the gather
        peaks["device"] += live_extra_bytes(pred, cfg.zero.max_live_parameters_numel, s.world_size)
    short: dict[str, int] = {}
    for memory, have in (("device", gpu_budget), ("host", mem.cpu), ("disk", mem.nvme)):
        if have is not None and peaks[memory] > have:
            short[memory] = peaks[memory] - have
    if gpu_budget is not None and pred.memory.get("gpu") == "host":  # no GPU: the gpu tier's own budget
        over = int(pred.needs["gpu"]["total"]) + pred.live_bytes - gpu_budget if "gpu" in pred.needs else 0
        if over > 0:
            short["device"] = over
    knobs["max_in_cpu"] = 0  # nothing on NVMe to keep in cpu
    if knobs["offload_param"] == "nvme":  # [Note: config search]: max_in_cpu from the room left
        room = (
            None
            if cpu_budget is None
            else max(0, cpu_budget - (int(pred.needs["cpu"]["total"]) if "cpu" in pred.needs else 0))
        )
        itemsize = pred.placement.compute_dtype.itemsize
        sized = None if room is None else room // itemsize
        knobs["max_in_cpu"] = s.max_in_cpu if s.max_in_cpu is not None else sized
        if knobs["max_in_cpu"] is None:  # no cpu_mem given: the config's own value
            knobs["max_in_cpu"] = cfg.zero.offload_param.max_in_cpu_numel
    # [Note: residency]: what the cpu tier keeps within the budget written (the kept copies live
    # in the cpu tier, inside its budget, beyond its need)
    pred = dataclasses.replace(pred, residency=_residency_at(pred, cfg, cpu_budget, knobs["max_in_cpu"]))
    peaks["host"] += pred.residency.bytes_in("cpu")
    if cpu_budget is not None and any(
        pred.memory.get(t) == "disk" and d["homes"] for t, d in pred.needs.items()
    ):
        # [Note: a cpu tier caches up to its budget]
        peaks["host"] = max(peaks["host"], pred.host_extra_bytes + on_host + other_host + cpu_budget)
    budgets["cpu"] = cpu_budget
    config = candidate_config(knobs, base, nvme_path=s.nvme_path, budgets=budgets)
    knobs["max_live_parameters"] = cfg.zero.max_live_parameters_numel  # the value in force, shown
    seconds, traffic, _, _ = config_seconds_per_step(
        pred,
        cfg,
        s.bandwidth,
        compute_flops=s.compute_flops,
        shared_cores=s.device_kind == "cpu",
        checkpointing=s.checkpointing,
    )
    return Candidate(knobs, config, pred, short, peaks=peaks, traffic=traffic, seconds_per_step=seconds)


def _residency_at(pred: Prediction, cfg: TieredConfig, cpu_budget: int | None, max_in_cpu: int) -> Residency:
    """[Note: residency] of a candidate with the cpu budget and ``max_in_cpu`` it is written with."""
    op = dataclasses.replace(cfg.zero.offload_param, max_in_cpu_numel=int(max_in_cpu))
    final = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, offload_param=op))
    rooms = {"cpu": TierRoom(cpu_budget)} if cpu_budget is not None else {}
    need = {t: d["total"] for t, d in pred.needs.items()}
    return config_residency(list(pred.groups), list(pred.plans), final, need, pred.memory, rooms)


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None
    weighed: tuple[Candidate, ...]
    setup: Setup | None = None
    """What every candidate shared (re-weighed at more memory: tiered.planning.more_memory)."""
    pinned: Pinned = field(default_factory=Pinned)

    @property
    def closest(self) -> Candidate | None:
        """The config nearest to fitting (least bytes short in all), for the refusal."""
        return _closest(self.weighed)

    def per_placement(self) -> list[Candidate]:
        """Per placement weighed (in `PLACEMENTS`' order): its fastest config that fits, else its
        closest, else one the engine refuses (with why): the rows of the plan's placement table."""
        out = []
        for placement in PLACEMENTS:
            mine = [c for c in self.weighed if c.placement == placement]
            best = _fastest(c for c in mine if c.fits) or _closest(mine) or next(iter(mine), None)
            if best is not None:
                out.append(best)
        return out


def _fastest(candidates: Iterable[Candidate]) -> Candidate | None:
    return min(
        candidates,
        key=lambda c: (round(c.seconds_per_step, 6), c.peaks["host"], c.peaks["device"]),
        default=None,
    )


def _closest(candidates: Iterable[Candidate]) -> Candidate | None:
    counted = [c for c in candidates if c.prediction is not None]
    return min(counted, key=lambda c: sum(c.shortfalls.values()), default=None)


def search(
    model: nn.Module,
    mem: Memories,
    pinned: Pinned = NOTHING_PINNED,
    *,
    tokens_per_step: int | None = None,
    **setup: Any,
) -> SearchResult:
    """Every candidate of `knob_grid`, weighed; the fastest that fits (ties: less host memory).
    `setup` the fields of `Setup` (the base config's own knobs are pinned too, by their keys);
    with `tokens_per_step` (per rank) the compute counts at the bandwidth's ``"flops"``
    ([Note: step time model])."""
    s = Setup(model, mem, **setup)
    own = s.base.pins()
    pinned = pinned.merged(Pinned(own, {k: config_name(k) for k in own}))
    if pinned.get("overlap_step") and s.base.cfg.precision.dtype == torch.float16:  # `overlap_blockers`
        raise ConfigError(
            f"contradictory pinned knobs: {pinned.name('overlap_step')} on, but fp16 needs the overflow "
            "check over every gradient before the first update; use bf16 or turn the overlap off"
        )
    if tokens_per_step:
        params = sum(p.numel() for p in model.parameters())
        flops = training_flops(params, tokens_per_step, checkpointing=s.checkpointing)
        s = dataclasses.replace(s, compute_flops=flops)
    if pinned.get("max_in_cpu") is not None:
        s = dataclasses.replace(s, max_in_cpu=pinned.get("max_in_cpu"))
    weighed = []
    for knobs in knob_grid(pinned, nvme=s.nvme_path is not None):
        knobs["overlap_step"] = pinned.get("overlap_step")
        weighed.append(_weigh(s, knobs, pinned.get("max_live_parameters")))
    for c in [c for c in SearchResult(None, tuple(weighed)).per_placement() if c.fits]:
        if (filled := fill_gpu_room(s, c, pinned.get("ratio") is not None, _weigh_at)) is not c:
            weighed.append(filled)  # [Note: the GPU's room searched]: each placement's fastest, filled
    return SearchResult(_fastest(c for c in weighed if c.fits), tuple(weighed), s, pinned)


def shortfall_text(c: Candidate) -> str:
    """Every tier a config is short on, each with the keys that fix it ([Note: config search])."""
    fix = {
        "device": "lower zero_optimization.sub_group_size or stage3_param_persistence_threshold, or offload "
        "parameters (zero_optimization.offload_param.device)",
        "host": 'move state to NVMe (zero_optimization.offload_optimizer.device / offload_param.device "nvme", '
        'tiered.grad_tier "nvme"), lower zero_optimization.sub_group_size or offload_optimizer.buffer_count',
        "disk": "point nvme_path at a larger disk",
    }
    label = {"device": "GPU", "host": "host memory", "disk": "NVMe"}
    return "; ".join(
        f"{label[m]} short by {format_bytes(b, binary=True)}: {fix[m]}" for m, b in c.shortfalls.items()
    )
