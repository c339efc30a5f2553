"""The one memory model: what a config needs on each tier, from the groups the engine plans.

[Note: one memory model]
The engine's pre-flight check ([Note: capacity check before training], tiered/engine/build.py)
and `tiered plan` take their numbers from this module, never from two formulas:

* the groups are `tiered.zero.layout.plan_layout`'s (the ZeRO-3 scheduler's own planner: blocks,
  leaves, persistence, ``sub_group_size`` splits, the gather need); `tiered plan --model` runs it
  over the real module tree built on the meta device, `--params` over the documented stand-in of
  [Note: shape model for --params] (tiered/planning/shape_model.py);
* where each group's optimizer step runs and its state lives is
  `tiered.optim.placement.plan_optimizer_placement`, the state partitions
  `state_partition_specs`, the staging `pipeline_bytes` at the tile the step runs in
  (``sub_group_size`` elements: DeepSpeed's meaning, so the staging is bounded by
  ``buffer_count x tile x bytes`` whatever the largest parameter);
* `capacity_needs` sums them per tier: homes + gather + persistent + pipeline.

The engine calls `engine_needs` with the groups it created; the planner calls `predict` with
stand-ins of the same groups (`ShardGroup`s whose partitions are only a home and a size): a
test (tests/test_plan_engine_agree.py) holds the two equal on a zoo of shapes.

Host memory is more than the host tiers. Four more terms, all in `Prediction.host_extra_bytes`:

* the process itself (the interpreter, torch, transformers and tiered imported, the model
  skeleton): `host_baseline_bytes`, per device kind. "cpu" (no CUDA: the "gpu" tier is host
  memory) was measured by benchmarks/host_baseline.py: a fresh interpreter imports torch,
  transformers, tiered and the nvme backend, builds a 6-layer hidden-512 Llama on the meta
  device, runs one bf16 training step of a tiny real Llama (the code pages and thread pools the
  compute brings in, ~22 MiB: [Note: compute memory on a CPU-only machine]) and reads VmHWM
  from /proc/self/status: 469.8-471.0 MiB over 3 runs in an environment installed minutes before
  (torch 2.13.0+cpu, transformers 5.25.0, Linux x86-64, 2026-12-05), so 471 MiB. The same
  process measures 376-386 MiB once the kernel has dropped the libraries' pages and read them
  back (2026-12-04's figure, and the same environment after `posix_fadvise(DONTNEED)` on torch's
  libraries): pages a fresh install wrote sit in the page cache in large folios, and a fault in
  a mapped library maps the whole folio, so libtorch_cpu.so alone is 97 MiB resident instead
  of 50. These are file pages the kernel may drop, but they are RSS; the model takes the
  larger figure (a new environment's first run, and every CI run), so a plan is never below
  the RSS it predicts for that reason. "cuda" was
  measured the same way, before the step was added, with the context created and cuBLAS loaded
  by one bf16 product (``host_baseline.py --cuda``) on an H200 (torch 2.11.0+cu130,
  transformers 5.17.0, driver 580.159.04, tiered at b3098e7, 2026-12-04): 1062 MiB over 3 runs
  (to 0.4 MiB); importing a CUDA build of torch alone took 804 MiB there (its CUDA libraries),
  the context and cuBLAS 258 MiB more (not re-measured with the tiny step: no GPU since).
  The pre-flight takes the kind from the engine's own gpu tier, ``auto_config`` from the
  process's compute device, `tiered plan` from ``--device`` (default cuda: it plans for a GPU);
* the transient fp32 copies the engine holds outside the tiers (a group's fp32 shard while it
  is initialised, a gradient while it is reduced and flushed: at most the largest group's, per
  [Note: host allocations and glibc's heap] freed whole), with a compressed optimizer-state
  format also its decode scratch: `outside_tiers_bytes`;
* the modules a run imports beyond the baseline's: peft, for a LoRA run (`PEFT_IMPORT_BYTES`,
  measured as the baseline was, its import and the LoRA wrapping of the meta skeleton: 12.9 MiB
  over 3 runs, peft 0.21.2; the import alone 8.5 MiB), so 13 MiB;
* each tier's backend's own host buffers, which no budget covers (the nvme backend's
  ``workers x chunk_bytes`` bounce buffers: 8 x 8 MiB at DeepSpeed's aio defaults), as the
  backend class states them from its spec (`tiered.storage.StorageBackend.host_buffer_bytes`,
  read through the registry: [Note: lazy backend registry] imports only the tiers' own plugins);
  counted whole, as a CUDA process pins them at first use (on the CPU their pages become
  resident as bounce pieces touch them, so there the count is an upper bound).

At ``close()`` (``restore_weights``, the default) the module gets its weights back one group at
a time while the tiers drop that group's partitions ([Note: restore at close group by group]), so
close adds one group's weights in the compute dtype, counted with the transients above (it was
the whole model's bf16 bytes, measured as the run's host peak before: benchmarks/RESULTS.md,
issue 21). The compute's own working memory (activations, autograd temporaries) is device
memory on a GPU (``--activation-mem``, taken off the gpu budget) but host memory on a CPU-only
machine: there the search adds the activations it is told about to the host figure ([Note:
compute memory on a CPU-only machine]). Not counted: the search itself where it runs in the
process that trains (``auto_config``; `tiered plan` is a process of its own): its configs and
group stand-ins, 11 MiB for a 6-layer Llama and 25 MiB for a 24-layer one (VmHWM, 392 configs
weighed, 2026-12-04). On the CPU an MoE's compute also builds a kernel for each token count
its experts get, host memory that grows for ~30 steps and then levels off: the activation
estimate counts it ([Note: per-shape kernels of a CPU MoE] in tiered/finetune/activations.py),
so it is in the host figure wherever the activations are.

`tiered plan` adds all four to the host tiers' need before it compares with ``--cpu-mem`` and
writes only what is left as the cpu tier's budget; the engine computes them with the same
`host_extra` and reports them, and their sum with its host tiers, in ``stats()["host_memory"]``
beside its peak RSS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn

from tiered.config.schema import TieredConfig
from tiered.optim.placement import (
    GroupPlan,
    decode_scratch_numel,
    optimizer_tile_numel,
    pipeline_bytes,
    plan_optimizer_placement,
    state_partition_specs,
)
from tiered.optim.state_format import FORMATS
from tiered.planning.homes import Placement, choose_placement
from tiered.planning.residency import Residency, TierRoom, config_residency
from tiered.shards import ParamEntry, ShardGroup, group_name
from tiered.units import format_bytes
from tiered.zero.budget import UNCHECKED_MAX_LIVE
from tiered.zero.layout import persists_by_room

if TYPE_CHECKING:
    from tiered.tiers import Partition
    from tiered.zero.budget import GpuGatherNeed
    from tiered.zero.layout import GroupLayout

HOST_BASELINE_BYTES = {"cpu": 471 * 2**20, "cuda": 1062 * 2**20}
"""The process before any tier, per device kind, measured: see [Note: one memory model]."""
DEVICE_KINDS = tuple(HOST_BASELINE_BYTES)
PEFT_IMPORT_BYTES = 13 * 2**20
"""What a peft (LoRA) run imports and builds beyond the baseline, measured: see [Note: one memory model]."""
MEMORY_BACKENDS = {"gpu": "device", "cpu": "host"}
"""Backend type -> the memory it takes; every other backend stores on disk (nvme, stripe, ...)."""


def host_baseline_bytes(device_kind: str) -> int:
    """The process's host memory before any tier on a `device_kind` ("cpu" or "cuda") machine."""
    try:
        return HOST_BASELINE_BYTES[device_kind]
    except KeyError:
        raise ValueError(f"device kind {device_kind!r}: expected one of {', '.join(DEVICE_KINDS)}") from None


def backend_host_bytes(cfg: TieredConfig) -> dict[str, int]:
    """Per tier, the host buffers its backend holds of its own ([Note: one memory model]); tiers
    whose backend holds none are left out."""
    from tiered.storage.registry import spec_host_buffer_bytes

    out: dict[str, int] = {}
    for name, spec in cfg.tiered.tiers.items():
        b = spec_host_buffer_bytes(dict(spec.backend))
        if b:
            out[name] = b
    return out


class TierNeed(TypedDict):
    """What one tier needs ([Note: one memory model]); a dict, so `tiered plan --json` writes it as is."""

    homes: int
    """Bytes of the partitions homed there (parameters, gradients, optimizer states)."""
    gather: int
    """Bytes to gather the largest module (gpu only)."""
    persistent: int
    """Bytes of the persistent parameters (gpu only)."""
    pipeline: int
    """Bytes of the optimizer pipeline's staging buffers."""
    module: str
    """What the gather is for (the largest module), "" where there is none."""
    to_write: list[int]
    """nbytes of each partition not created yet (the optimizer states)."""
    total: int
    """homes + gather + persistent + pipeline."""


def pipeline_need(
    groups: Sequence[ShardGroup], plans: Sequence[GroupPlan], cfg: TieredConfig, compute_dtype: torch.dtype
) -> dict[str, int]:
    """The optimizer pipeline's staging per tier, tiled at ``sub_group_size`` ([Note: one memory model])."""
    return pipeline_bytes(
        groups,
        plans,
        cfg.zero.offload_optimizer.buffer_count,
        compute_dtype,
        optimizer_tile_numel(cfg),
        FORMATS[cfg.tiered.optimizer_state_format],
    )


def capacity_needs(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    gpu_need: GpuGatherNeed,
    *,
    pipeline: dict[str, int],
    compute_dtype: torch.dtype,
    tile_numel: int,
    state_format: str = "fp32",
) -> dict[str, TierNeed]:
    """Per tier, what it needs (`TierNeed`). `groups` are all of them (their param and grad partitions exist already), `plans`
    one per trainable group. See [Note: capacity check before training]."""
    need: dict[str, TierNeed] = {}

    def at(tier: str) -> TierNeed:
        return need.setdefault(
            tier,
            TierNeed(homes=0, gather=0, persistent=0, pipeline=0, module="", to_write=[], total=0),
        )

    for g in groups:
        at(g.param.home)["homes"] += g.param.nbytes
        if g.grad is not None:
            at(g.grad.home)["homes"] += g.grad.nbytes
    for g, p in zip([g for g in groups if g.trainable], plans, strict=True):  # frozen: no state
        for _, numel, dtype, home in state_partition_specs(
            g, p, compute_dtype, tile_numel, FORMATS[state_format]
        ):
            nbytes = numel * dtype.itemsize
            at(home)["homes"] += nbytes
            at(home)["to_write"].append(nbytes)
    gpu = at("gpu")
    gpu["persistent"] = gpu_need.persistent_bytes
    if gpu_need.gather_bytes:
        gpu["gather"] = gpu_need.gather_bytes
        gpu["module"] = repr(gpu_need.largest_module)
    for tier, b in pipeline.items():
        at(tier)["pipeline"] += b
    for d in need.values():
        d["total"] = d["homes"] + d["gather"] + d["persistent"] + d["pipeline"]
    return need


def engine_needs(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    gpu_need: GpuGatherNeed,
    cfg: TieredConfig,
    compute_dtype: torch.dtype,
) -> dict[str, TierNeed]:
    """`capacity_needs` with the pipeline of `pipeline_need`: what the engine checks."""
    trainable = [g for g in groups if g.trainable]
    pipe = pipeline_need(trainable, plans, cfg, compute_dtype)
    return capacity_needs(
        groups,
        plans,
        gpu_need,
        pipeline=pipe,
        compute_dtype=compute_dtype,
        tile_numel=optimizer_tile_numel(cfg),
        state_format=cfg.tiered.optimizer_state_format,
    )


def outside_tiers_bytes(
    groups: Sequence[ShardGroup], decode_scratch_numel: int = 0, *, compute_itemsize: int = 4
) -> int:
    """Host bytes the engine holds outside its tiers at its peak ([Note: one memory model]): the
    largest of the transients one group brings (its fp32 shard while it is initialised or its
    gradient reduced; its whole weights in the compute dtype, `compute_itemsize` bytes each, while
    `close()` restores it: [Note: restore at close group by group]; never at once), plus the two
    fp32 tensors a compressed optimizer-state format decodes a tile's moments into
    (`decode_scratch_numel` elements each; they live for the whole run)."""
    shard = max((g.shard_numel * 4 for g in groups), default=0)
    restored = max((g.full_numel * compute_itemsize for g in groups), default=0)
    return max(shard, restored) + 8 * decode_scratch_numel


def is_peft_model(model: nn.Module) -> bool:
    """A peft PeftModel (duck-typed, as tiered.checkpoint.export's: peft is optional)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


class HostExtra(TypedDict):
    """Host memory a run takes beyond its tiers ([Note: one memory model]); a dict, so
    ``engine.stats()["host_memory"]`` writes it as is."""

    baseline: int
    """`host_baseline_bytes` of the device kind."""
    outside_tiers: int
    """`outside_tiers_bytes`: the largest one-group transient (an fp32 shard, or close's copy of a group
    in the compute dtype), a compressed format's decode scratch."""
    backends: dict[str, int]
    """tier -> its backend's own host buffers (`backend_host_bytes`)."""
    imports: int
    """Modules the run imports beyond the baseline's (peft: `PEFT_IMPORT_BYTES`)."""
    live: int
    """Where the "gpu" tier is host memory (no GPU): the parameters the live budget keeps gathered
    beyond the largest module's gather, which the gpu tier's need counts ([Note: the live budget
    searched]); on a GPU they are the device's."""


def host_extra(
    groups: Sequence[ShardGroup],
    plans: Sequence[GroupPlan],
    cfg: TieredConfig,
    *,
    device_kind: str,
    compute_dtype: torch.dtype,
    peft: bool = False,
    needs: Mapping[str, TierNeed] | None = None,
    memory: Mapping[str, str] | None = None,
    world_size: int = 1,
) -> HostExtra:
    """What `predict` and the engine (``stats()["host_memory"]``) add to the host tiers' need;
    `needs` and `memory` (the tiers') for the live budget's bytes on a machine without a GPU."""
    trainable = [g for g in groups if g.trainable]
    live = 0
    if memory is not None and memory.get("gpu") == "host":
        gathered = sum(
            g.full_numel for g in groups if not g.persistent and (g.param.home != "gpu" or world_size > 1)
        )
        held = min(cfg.zero.max_live_parameters_numel, gathered) * _live_element_bytes(
            compute_dtype.itemsize, world_size
        )
        gather = int(needs["gpu"]["gather"]) if needs is not None and "gpu" in needs else 0
        live = max(0, int(held) - gather)
    scratch = decode_scratch_numel(
        trainable, plans, optimizer_tile_numel(cfg), FORMATS[cfg.tiered.optimizer_state_format]
    )
    return HostExtra(
        baseline=host_baseline_bytes(device_kind),
        outside_tiers=outside_tiers_bytes(groups, scratch, compute_itemsize=compute_dtype.itemsize),
        backends=backend_host_bytes(cfg),
        imports=PEFT_IMPORT_BYTES if peft else 0,
        live=live,
    )


def tier_memory(cfg: TieredConfig, name: str, *, gpu_is_host: bool) -> str:
    """ "device", "host" or "disk": what tier `name` of `cfg` takes its bytes from."""
    spec = cfg.tiered.tiers.get(name)
    kind = MEMORY_BACKENDS.get(str(spec.backend.get("type")) if spec is not None else name, "disk")
    return "host" if kind == "device" and gpu_is_host else kind


@dataclass(frozen=True)
class _SizedPartition:
    """What the memory model reads of a partition: its home and size."""

    name: str
    home: str
    nbytes: int


@dataclass(frozen=True)
class Prediction:
    """What one config needs, tier by tier, as the engine will check it."""

    placement: Placement
    needs: dict[str, TierNeed]
    """`capacity_needs`'s answer."""
    memory: dict[str, str]
    """tier -> "device", "host" or "disk"."""
    groups: tuple[ShardGroup, ...]
    plans: tuple[GroupPlan, ...]
    outside_tiers_bytes: int
    baseline_bytes: int
    """`host_baseline_bytes` of the device kind predicted for."""
    backend_bytes: dict[str, int] = field(default_factory=dict)
    """tier -> its backend's own host buffers (`backend_host_bytes`)."""
    imports_bytes: int = 0
    """Modules the run imports beyond the baseline's (`HostExtra.imports`)."""
    residency: Residency = field(default_factory=Residency)
    """What the faster tiers keep across steps within the config's budgets ([Note: residency]):
    inside each tier's budget, beyond its need."""
    live_bytes: int = 0
    """`HostExtra.live`: gathered parameters held in host memory beyond the gather (no GPU)."""

    @property
    def host_extra_bytes(self) -> int:
        """Host memory the run takes beyond its tiers: the process, the transients outside the
        tiers and the backends' buffers ([Note: one memory model])."""
        return (
            self.baseline_bytes
            + self.outside_tiers_bytes
            + sum(self.backend_bytes.values())
            + self.imports_bytes
            + self.live_bytes
        )

    def tier_bytes(self, memory: str) -> int:
        """The tiers' need on one kind of memory (no process baseline), with what they keep
        across steps inside their budgets ([Note: residency])."""
        kept = sum(self.residency.bytes_in(t) for t, m in self.memory.items() if m == memory)
        return kept + sum(d["total"] for t, d in self.needs.items() if self.memory.get(t) == memory)

    def peak_bytes(self, memory: str) -> int:
        """What the run takes of one kind of memory; host includes the process and what the
        engine holds outside the tiers."""
        extra = self.host_extra_bytes if memory == "host" else 0
        return self.tier_bytes(memory) + extra

    @property
    def largest_group_numel(self) -> int:
        return max((g.shard_numel for g in self.groups), default=0)


def live_gpu_bytes(pred: Prediction, max_live: int, world_size: int) -> int:
    """[Note: the live budget searched]: the gpu bytes ``stage3_max_live_parameters`` lets the
    parameter schedule hold (gathered, prefetched, kept for the backward), at most every
    gathered group at once; 0 where nothing is gathered (parameters homed on one rank's GPU)."""
    gathered = [g for g in pred.groups if not g.persistent and (g.param.home != "gpu" or world_size > 1)]
    itemsize = pred.placement.compute_dtype.itemsize
    return int(min(max_live, sum(g.full_numel for g in gathered)) * _live_element_bytes(itemsize, world_size))


def _live_element_bytes(itemsize: int, world_size: int) -> float:
    # a gathered full buffer plus, with several ranks, its shard
    return itemsize * ((1 + 1 / world_size) if world_size > 1 else 1)


def live_extra_bytes(pred: Prediction, max_live: int, world_size: int) -> int:
    """The gpu bytes the live budget holds beyond the largest module's gather (which the gpu
    tier's need counts already): what the plan's GPU peak and the engine's pre-flight add
    ([Note: the live budget searched])."""
    gather = pred.needs["gpu"]["gather"] if "gpu" in pred.needs else 0
    return max(0, live_gpu_bytes(pred, max_live, world_size) - gather)


def live_budget_shortfall(pred: Prediction, max_live: int, world_size: int, gpu_budget: int | None) -> str:
    """The refusal when the gpu tier's need plus `live_extra_bytes` passes `gpu_budget`, naming
    ``zero_optimization.stage3_max_live_parameters`` and the largest value that fits; "" when it
    fits, or when the tier's need alone is over (that shortfall is the tier's own refusal). Only
    a budget the config sets is checked: DeepSpeed's default (1e9) and 0 (no cap) stay caps the
    gpu tier's budget enforces by evicting under pressure, as a config written for DeepSpeed
    expects of a model larger than the GPU; the plan counts the default's bytes all the same, so
    what it recommends is never refused here."""
    need = pred.needs["gpu"]["total"] if "gpu" in pred.needs else 0
    if max_live in UNCHECKED_MAX_LIVE:
        return ""
    extra = live_extra_bytes(pred, max_live, world_size)
    if gpu_budget is None or extra == 0 or need > gpu_budget or need + extra <= gpu_budget:
        return ""
    gather = pred.needs["gpu"]["gather"]
    per = _live_element_bytes(pred.placement.compute_dtype.itemsize, world_size)
    fits = int((gpu_budget - need + gather) // per)
    return (
        f"gpu budget {format_bytes(gpu_budget, binary=True)} < "
        f"{format_bytes(need + extra, binary=True)} needed with "
        f"zero_optimization.stage3_max_live_parameters={max_live} (the tier's "
        f"{format_bytes(need, binary=True)} + {format_bytes(extra, binary=True)} of gathered parameters kept "
        f"live beyond the largest module's gather); set zero_optimization.stage3_max_live_parameters to at "
        f"most {fits} (what fits the budget), or raise tiered.tiers.gpu.budget"
    )


def predict(
    model: nn.Module,
    cfg: TieredConfig,
    *,
    world_size: int = 1,
    gpu_is_host: bool = False,
    device_kind: str | None = None,
    layouts: dict[tuple[object, ...], tuple[GroupLayout, list[ShardGroup]]] | None = None,
    rooms: Mapping[str, TierRoom] | None = None,
) -> Prediction:
    """What `tiered.initialize(model, cfg)` would check, without creating a tier: the same
    group planning, placement and sums ([Note: one memory model]). `model` may be on the meta
    device. Raises what the engine raises when a module can never be gathered. `layouts` caches
    the group layout across configs that plan the same groups (the search's). `device_kind`
    ("cpu", "cuda") picks the process baseline; None: "cpu" when the gpu tier is host memory.
    `rooms`: the tiers' budgets as an engine's manager enforces them ([Note: residency]; default:
    the budgets the config states, a tier without one keeping nothing)."""
    placement = choose_placement(cfg)
    dtype = placement.compute_dtype
    gpu_spec = cfg.tiered.tiers.get("gpu")
    gpu_budget = gpu_spec.budget_bytes if gpu_spec is not None else None
    z = cfg.zero
    gpu_stepped = _gpu_stepped_grad_tier(cfg, placement)
    key = (
        z.sub_group_size_numel,
        z.param_persistence_threshold_numel,
        z.model_persistence_threshold_numel,
        z.max_live_parameters_numel,
        repr(z.leaf_module),
        gpu_budget,
        dtype,
        world_size,
        placement.param_tier,
        placement.grad_tier,
        gpu_stepped,
        # [Note: a GPU-stepped gradient stays on the GPU]: the ratio decides the layout only where
        # those gradients are homed apart (the GPU room's search weighs many ratios: one layout)
        float(z.offload_optimizer.ratio) if gpu_stepped != placement.grad_tier else None,
        # [Note: persistent by room]: what the gpu budget's room holds persistent depends on these
        persists_by_room(cfg),
        int(cfg.gradient_accumulation_steps),
        z.max_reuse_distance_numel,
    )
    cached = None if layouts is None else layouts.get(key)
    if cached is None:
        cached = _planned_groups(model, cfg, placement, gpu_budget, world_size)
        if layouts is not None:
            layouts[key] = cached
    layout, groups = cached
    trainable = [g for g in groups if g.trainable]
    plans = plan_optimizer_placement(trainable, cfg, placement.optimizer_tier, gpu_is_host=gpu_is_host)
    needs = engine_needs(groups, plans, layout.gpu_need, cfg, dtype)
    memory = {t: tier_memory(cfg, t, gpu_is_host=gpu_is_host) for t in {*cfg.tiered.tiers, *needs}}
    kind = device_kind if device_kind is not None else ("cpu" if gpu_is_host else "cuda")
    extra = host_extra(
        groups,
        plans,
        cfg,
        device_kind=kind,
        compute_dtype=dtype,
        peft=is_peft_model(model),
        needs=needs,
        memory=memory,
        world_size=world_size,
    )
    # [Note: residency]: the budgets the config states (a tier without one lends nothing here; the
    # engine, which knows what its backend reports free, plans with that)
    if rooms is None:
        rooms = {
            n: TierRoom(s.budget_bytes) for n, s in cfg.tiered.tiers.items() if s.budget_bytes is not None
        }
    residency = config_residency(groups, plans, cfg, {t: d["total"] for t, d in needs.items()}, memory, rooms)
    return Prediction(
        placement,
        needs,
        memory,
        tuple(groups),
        tuple(plans),
        extra["outside_tiers"],
        extra["baseline"],
        extra["backends"],
        extra["imports"],
        residency,
        live_bytes=extra["live"],
    )


def groups_and_plans(
    model: nn.Module,
    cfg: TieredConfig,
    *,
    gpu_budget_bytes: int | None,
    gpu_is_host: bool,
    rooms: Mapping[str, TierRoom] | None = None,
) -> tuple[list[ShardGroup], list[GroupPlan], Residency]:
    """One rank's groups (stand-ins, as `predict` plans them) with the gpu tier's budget as the
    tier manager reports it, the optimizer's plan of each trainable one, and what the faster
    tiers keep at `rooms` (default: the budgets `cfg` states, as `predict`; [Note: residency]):
    what the bench's replayed pattern is built from ([Note: training I/O pattern])."""
    placement = choose_placement(cfg)
    layout, groups = _planned_groups(model, cfg, placement, gpu_budget_bytes, 1)
    trainable = [g for g in groups if g.trainable]
    plans = plan_optimizer_placement(trainable, cfg, placement.optimizer_tier, gpu_is_host=gpu_is_host)
    needs = engine_needs(groups, plans, layout.gpu_need, cfg, placement.compute_dtype)
    memory = {t: tier_memory(cfg, t, gpu_is_host=gpu_is_host) for t in {*cfg.tiered.tiers, *needs}}
    if rooms is None:
        rooms = {
            n: TierRoom(s.budget_bytes) for n, s in cfg.tiered.tiers.items() if s.budget_bytes is not None
        }
    residency = config_residency(groups, plans, cfg, {t: d["total"] for t, d in needs.items()}, memory, rooms)
    return groups, plans, residency


def _planned_groups(
    model: nn.Module, cfg: TieredConfig, placement: Placement, gpu_budget: int | None, world_size: int
) -> tuple[GroupLayout, list[ShardGroup]]:
    """`plan_layout`'s groups as `ShardGroup` stand-ins (a home and a size per partition). The
    search keeps them per layout key and shares them between the configs that plan the same
    groups: one copy per layout, not one per candidate, is what the search run in the process
    holds ([Note: one memory model])."""
    from tiered.zero.layout import plan_layout

    dtype = placement.compute_dtype
    layout = plan_layout(
        model,
        cfg.zero,
        gpu_budget_bytes=gpu_budget,
        compute_dtype=dtype,
        world_size=world_size,
        param_tier=placement.param_tier,
        grad_tier=placement.grad_tier,
        persist_by_room=persists_by_room(cfg),
        accumulation=int(cfg.gradient_accumulation_steps),
        gpu_stepped_grad_tier=_gpu_stepped_grad_tier(cfg, placement),
    )
    itemsize = torch.empty(0, dtype=dtype).element_size()
    groups: list[ShardGroup] = []
    for i, pg in enumerate(layout.planned):
        entries, off = [], 0
        for qual, p, start, n in pg.slots():
            entries.append(ParamEntry(qual, off, n, tuple(p.shape), start))
            off += n
        shard = layout.shard_numel(i)
        name = group_name(i)
        param = _SizedPartition(f"{name}.param", placement.param_tier, shard * itemsize)
        home = layout.grad_homes[i]  # [Note: a GPU-stepped gradient stays on the GPU]
        grad = _SizedPartition(f"{name}.grad", home, shard * 4) if home is not None else None
        groups.append(
            ShardGroup(
                i,
                name,
                tuple(entries),
                shard * world_size,
                shard,
                0,
                _as_partition(param),
                None if grad is None else _as_partition(grad),
                pg.persistent,
            )
        )
    return layout, groups


def _gpu_stepped_grad_tier(cfg: TieredConfig, placement: Placement) -> str:
    """[Note: a GPU-stepped gradient stays on the GPU], as the engine asks it (a storage tier is
    one whose memory kind is "disk")."""
    from tiered.optim.placement import gpu_stepped_grad_tier

    storage = tier_memory(cfg, placement.grad_tier, gpu_is_host=False) == "disk"
    return gpu_stepped_grad_tier(cfg, placement.grad_tier, storage)


def _as_partition(p: _SizedPartition) -> Partition:
    # the memory model reads only .name, .home and .nbytes of a partition
    return p  # type: ignore[return-value]
