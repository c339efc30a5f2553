"""The memory model behind `tiered plan`: bytes per rank on each tier, per ZeRO strategy.

[Note: plan accounting]
Symbols: Ψ parameters, N data-parallel ranks, p / g bytes per 16-bit parameter / gradient
(2 / 2 for bf16 and fp16, 4 / 4 for fp32) and K bytes of Adam state per parameter.

* K = 12 in mixed precision (fp32 master copy, exp_avg, exp_avg_sq). In fp32, K = 8 (exp_avg,
  exp_avg_sq) because the fp32 parameter *is* the master, DeepSpeed-style: 4 + 4 + 8 = 16 B.
* Model states on the GPU, the ZeRO paper's formulas (docs/architecture.md, "Memory model"):
  DP (p+g+K)Ψ;  ZeRO-1 (p+g)Ψ + KΨ/N;  ZeRO-2 pΨ + (g+K)Ψ/N;  ZeRO-3 (p+g+K)Ψ/N.
* Offloaded ZeRO-3 (ZeRO-Offload / ZeRO-Infinity), per rank:
  - the optimizer's tier holds 12 B per parameter of the shard (fp32 master, m, v) in every
    precision: once the optimizer leaves the GPU its master cannot be the GPU's parameter copy
    (DeepSpeed keeps a separate fp32 partition as well);
  - gradients leave the GPU as each module's backward ends and accumulate in fp32 in host
    memory: 4 B per parameter of the shard on the CPU, also when the optimizer is on NVMe (see
    docs/architecture.md, "The data path of one step"; DeepSpeed swaps them to NVMe instead);
  - offloaded parameters: p B per parameter of the shard on the CPU or NVMe instead of the GPU;
  - pinned staging in host memory for NVMe: optimizer on NVMe = 3 states x 3 pipeline slots
    (read i+1, compute i, write i-1) x sub_group_size x 4 B; parameters on NVMe =
    param_buffer_count (DeepSpeed's offload_param.buffer_count, 5) x largest layer x p.
* GPU working set, counted for every ZeRO-3 variant on top of its model states (see
  `working_set`): the gathered largest layer plus `prefetch_layers` more of that size in flight
  ((1 + prefetch) x largest x p), one largest layer's full gradient before it is reduced and
  sent away (largest x g), persistent small parameters kept whole on every rank (x p), and the
  activations the user declares (--activation-mem; 0 by default: *not counted*, they depend on
  batch size, sequence length and checkpointing). "Largest layer" = the most parameters one
  module owns directly: that is what one ZeRO-3 fetch gathers. DP / ZeRO-1 / ZeRO-2 gather
  nothing: their working set is activations only.
* Communication per step per rank, at the paper's level (not multiplied by (N-1)/N, 0 when
  N = 1): DP / ZeRO-1 / ZeRO-2 move 2Ψ elements (reduce-scatter + all-gather = one all-reduce)
  of g bytes; ZeRO-3 moves 3Ψ elements of p bytes (all-gather in forward, again in backward,
  reduce-scatter of gradients): 1.5x DP.
* Host link (PCIe) per step per rank: optimizer offloaded = gradients down (gΨ/N) + updated
  parameters up (pΨ/N); parameters offloaded = fetched up in forward and backward (2pΨ/N)
  instead of the upload after the step. NVMe traffic per step: optimizer on NVMe = 12 B read +
  12 B written per parameter of the shard; parameters on NVMe = 2p read + p written.
* Gradients on NVMe (``tiered.grad_tier: "nvme"``, [Note: gradients on nvme]): the 4 B per
  parameter leave host memory for NVMe; host memory keeps one sub-group's gradient staged for a
  flush plus 3 pipeline slots of gradients the optimizer reads (4 x sub-group x 4 B). NVMe
  traffic adds, per parameter of the shard, 4 B read + 4 B written at every micro-batch's flush
  (read-add-write) and 4 B read by the optimizer: 12 B per step at one micro-batch per step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast

from tiered.errors import ConfigError

Precision = Literal["bf16", "fp16", "fp32"]
Tier = Literal["gpu", "cpu", "nvme"]
TIERS: tuple[Tier, ...] = ("gpu", "cpu", "nvme")

MIXED_OPTIMIZER_BYTES = 12
"""fp32 master + exp_avg + exp_avg_sq: what an offloaded optimizer keeps per parameter."""
HOST_GRAD_BYTES = 4
"""Gradients accumulate in fp32 in host memory once the optimizer is offloaded."""
OPTIMIZER_STAGING_SLOTS = 3 * 3
"""3 fp32 states x 3 pipeline slots (read i+1, compute i, write i-1)."""
GRAD_STAGING_SLOTS = 1 + 3
"""Gradients on NVMe: one sub-group staged for a flush + 3 the optimizer pipeline reads."""
NVME_GRAD_BYTES_PER_STEP = 12
"""Gradients on NVMe, per parameter and step (one micro-batch): flush read + write, step read."""


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter for one precision. See [Note: plan accounting]."""

    param: int
    grad: int
    optimizer: int

    @staticmethod
    def of(precision: str) -> PrecisionBytes:
        if precision in ("bf16", "fp16"):
            return PrecisionBytes(param=2, grad=2, optimizer=12)
        if precision == "fp32":
            return PrecisionBytes(param=4, grad=4, optimizer=8)
        raise ConfigError(f"--precision: unknown precision {precision!r}; use bf16, fp16 or fp32")


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about a model, and where each number came from."""

    total_params: int
    largest_layer_params: int
    persistent_params: int
    source: str
    """Human text: "--params 40e9" or "model ./llama (LlamaForCausalLM)"."""
    assumptions: tuple[str, ...] = ()
    """Every number that was assumed rather than counted, in words."""
    trainable_params: int | None = None
    """Parameters that get gradients and optimizer state (LoRA adapters); None = all of them.
    The others are frozen: p bytes each, on the parameters' tier, nothing else."""

    def __post_init__(self) -> None:
        if self.total_params <= 0:
            raise ConfigError(
                f"model from {self.source}: parameter count must be positive, got {self.total_params}"
            )
        if not 0 <= self.largest_layer_params <= self.total_params:
            raise ConfigError(
                f"model from {self.source}: largest layer ({self.largest_layer_params}) must be between 0 "
                f"and the total parameter count ({self.total_params})"
            )
        if self.trainable_params is not None and not 0 < self.trainable_params <= self.total_params:
            raise ConfigError(
                f"model from {self.source}: trainable parameters ({self.trainable_params}) must be between 1 and "
                f"the total parameter count ({self.total_params})"
            )


@dataclass(frozen=True)
class Memories:
    """Bytes available per rank on each tier; None = not given, so that tier is not checked."""

    gpu_bytes: int | None = None
    cpu_bytes: int | None = None
    nvme_bytes: int | None = None

    def of(self, tier: str) -> int | None:
        return {"gpu": self.gpu_bytes, "cpu": self.cpu_bytes, "nvme": self.nvme_bytes}[tier]


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the model; defaults follow DeepSpeed's where one exists."""

    world_size: int = 1
    precision: Precision = "bf16"
    prefetch_layers: int = 1
    """Layers of the largest size gathered ahead of the one computing."""
    param_buffer_count: int = 5
    """Pinned buffers for NVMe parameters (DeepSpeed offload_param.buffer_count)."""
    sub_group_size: int = 100_000_000
    """Optimizer pipeline tile in elements. DeepSpeed's default is 1e9, which would need 36 GB of
    pinned staging with NVMe; 1e8 keeps it at 3.6 GB and still moves 400 MB per I/O."""
    activation_bytes: int = 0
    persistence_threshold: int = 100_000
    nvme_path: str = "./tiered_offload"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {self.world_size}")
        PrecisionBytes.of(self.precision)
        for name in ("prefetch_layers", "activation_bytes", "persistence_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("param_buffer_count", "sub_group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Term:
    """One named amount of bytes on one tier (so every total can be explained)."""

    tier: Tier
    what: str
    bytes: int


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy: where its bytes go, whether it fits, what it moves per step."""

    key: str
    name: str
    stage: int
    offload_optimizer: str
    offload_param: str
    terms: tuple[Term, ...]
    comm_bytes_per_step: int
    host_link_bytes_per_step: int
    nvme_io_bytes_per_step: int
    fits: dict[str, bool | None] = field(default_factory=dict)
    shortfall_bytes: dict[str, int] = field(default_factory=dict)
    grad_tier: str = "cpu"
    """Where the fp32 gradients live when the optimizer is offloaded ("cpu" or "nvme")."""

    def bytes_on(self, tier: str, *, working: bool | None = None) -> int:
        """Sum of terms on `tier`; working=True only the working set, False only model states."""
        return sum(
            t.bytes
            for t in self.terms
            if t.tier == tier and (working is None or t.what.startswith("working:") == working)
        )

    @property
    def fits_all(self) -> bool:
        return all(v is not False for v in self.fits.values())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["terms"] = [asdict(t) for t in self.terms]
        out["bytes"] = {tier: self.bytes_on(tier) for tier in TIERS}
        out["gpu_model_state_bytes"] = self.bytes_on("gpu", working=False)
        out["gpu_working_set_bytes"] = self.bytes_on("gpu", working=True)
        out["fits_all"] = self.fits_all
        return out


# key, name, stage, optimizer device, parameter device; the ZeRO-3 rows are in the recommendation
# order of [Note: plan accounting]'s caller: cheapest placement first.
STRATEGIES: tuple[tuple[str, str, int, str, str], ...] = (
    ("dp", "DP", 0, "none", "none"),
    ("zero1", "ZeRO-1", 1, "none", "none"),
    ("zero2", "ZeRO-2", 2, "none", "none"),
    ("zero3", "ZeRO-3", 3, "none", "none"),
    ("zero3_opt_cpu", "ZeRO-3 + optimizer on CPU", 3, "cpu", "none"),
    ("zero3_opt_param_cpu", "ZeRO-3 + optimizer + params on CPU", 3, "cpu", "cpu"),
    ("zero3_opt_nvme", "ZeRO-3 + optimizer on NVMe", 3, "nvme", "none"),
    ("zero3_opt_param_nvme", "ZeRO-3 + optimizer + params on NVMe", 3, "nvme", "nvme"),
    ("zero3_all_nvme", "ZeRO-3 + opt + params + grads on NVMe", 3, "nvme", "nvme"),
)
NVME_GRADIENTS = frozenset({"zero3_all_nvme"})
"""Strategies whose gradients live on NVMe ([Note: gradients on nvme])."""
RECOMMENDATION_ORDER = (
    "zero3",
    "zero3_opt_cpu",
    "zero3_opt_param_cpu",
    "zero3_opt_nvme",
    "zero3_opt_param_nvme",
    "zero3_all_nvme",
)


def model_state_bytes(stage: int, psi: int, n: int, b: PrecisionBytes) -> int:
    """GPU bytes per rank of the non-offloaded strategies: the formulas of docs/architecture.md, "Memory model", exactly."""
    p, g, k = b.param, b.grad, b.optimizer
    if stage == 0:
        return (p + g + k) * psi
    if stage == 1:
        return (p + g) * psi + _shard(k * psi, n)
    if stage == 2:
        return p * psi + _shard((g + k) * psi, n)
    if stage == 3:
        return _shard((p + g + k) * psi, n)
    raise ConfigError(f"ZeRO stage must be 0 (DP), 1, 2 or 3, got {stage}")


def _shard(total: int, n: int) -> int:
    # A rank holds the ceiling of its share: shards are padded to equal size.
    return -(-total // n)


def working_set(shape: ModelShape, opts: PlanOptions) -> tuple[Term, ...]:
    """GPU working set of any ZeRO-3 variant. See [Note: plan accounting]."""
    b = PrecisionBytes.of(opts.precision)
    big = shape.largest_layer_params
    terms = [
        Term(
            "gpu",
            f"working: gathered largest layer x (1 + {opts.prefetch_layers} prefetched)",
            (1 + opts.prefetch_layers) * big * b.param,
        ),
        Term("gpu", "working: gradient of the largest layer before reduce/offload", big * b.grad),
        Term("gpu", "working: persistent small parameters (kept whole)", shape.persistent_params * b.param),
    ]
    if opts.activation_bytes:
        terms.append(Term("gpu", "working: activations (--activation-mem)", opts.activation_bytes))
    return tuple(terms)


def strategy_plan(
    key: str, name: str, stage: int, opt_dev: str, param_dev: str, shape: ModelShape, opts: PlanOptions
) -> StrategyPlan:
    """The bytes one row of `STRATEGIES` needs on each tier, itemised ([Note: plan accounting])."""
    b = PrecisionBytes.of(opts.precision)
    psi, n = shape.total_params, opts.world_size
    shard = _shard(psi, n)
    # frozen parameters (LoRA's base): p bytes each, no gradient, no optimizer state
    psi_t = psi if shape.trainable_params is None else shape.trainable_params
    shard_t = _shard(psi_t, n)
    terms: list[Term] = []
    if opt_dev == "none":
        terms.append(Term("gpu", "model states (ZeRO formula)", model_state_bytes(stage, psi_t, n, b)))
        if psi_t < psi:
            frozen = psi - psi_t
            terms.append(
                Term(
                    "gpu",
                    "frozen parameters (no gradient or optimizer state)",
                    _shard(frozen * b.param, n) if stage == 3 else frozen * b.param,
                )
            )
    else:
        # [Note: plan accounting]: offloaded optimizer = 12 B + fp32 host gradients 4 B.
        if param_dev == "none":
            terms.append(
                Term("gpu", "16-bit parameter shard" if b.param == 2 else "parameter shard", shard * b.param)
            )
        else:
            terms.append(Term(cast(Tier, param_dev), "parameter shard (offloaded)", shard * b.param))
        if key in NVME_GRADIENTS:
            terms.append(
                Term("nvme", "fp32 gradient shard (tiered.grad_tier nvme)", shard_t * HOST_GRAD_BYTES)
            )
            terms.append(
                Term(
                    "cpu",
                    "staging: gradients (1 flushing + 3 optimizer slots x sub-group)",
                    GRAD_STAGING_SLOTS * min(opts.sub_group_size, shard_t) * 4,
                )
            )
        else:
            terms.append(Term("cpu", "fp32 gradient shard (host accumulation)", shard_t * HOST_GRAD_BYTES))
        terms.append(
            Term(cast(Tier, opt_dev), "optimizer shard: fp32 master + m + v", shard_t * MIXED_OPTIMIZER_BYTES)
        )
        if opt_dev == "nvme":
            tile = min(opts.sub_group_size, shard_t)
            terms.append(
                Term(
                    "cpu",
                    "pinned staging: optimizer pipeline (3 states x 3 slots x sub-group)",
                    OPTIMIZER_STAGING_SLOTS * tile * 4,
                )
            )
        if param_dev == "nvme":
            terms.append(
                Term(
                    "cpu",
                    f"pinned staging: {opts.param_buffer_count} parameter buffers x largest layer",
                    opts.param_buffer_count * shape.largest_layer_params * b.param,
                )
            )
    if stage == 3:
        terms.extend(working_set(shape, opts))
    elif opts.activation_bytes:
        terms.append(Term("gpu", "working: activations (--activation-mem)", opts.activation_bytes))

    comm = 0
    if n > 1:
        comm = 3 * psi * b.param if stage == 3 else 2 * psi * b.grad
    host_link = 0
    if opt_dev != "none":
        host_link = shard * b.grad + (2 * shard * b.param if param_dev != "none" else shard * b.param)
    nvme_io = 0
    if opt_dev == "nvme":
        nvme_io += 2 * shard * MIXED_OPTIMIZER_BYTES
    if param_dev == "nvme":
        nvme_io += 3 * shard * b.param
    grad_tier = "nvme" if key in NVME_GRADIENTS else "cpu"
    if grad_tier == "nvme":
        nvme_io += NVME_GRAD_BYTES_PER_STEP * shard_t
    return StrategyPlan(
        key, name, stage, opt_dev, param_dev, tuple(terms), comm, host_link, nvme_io, grad_tier=grad_tier
    )


def check_fit(s: StrategyPlan, mem: Memories) -> StrategyPlan:
    """`s` with `fits` and `shortfall_bytes` filled in against the memories the user gave."""
    fits: dict[str, bool | None] = {}
    short: dict[str, int] = {}
    for tier in TIERS:
        need, have = s.bytes_on(tier), mem.of(tier)
        if have is None:
            fits[tier] = None if need else True
        else:
            fits[tier] = need <= have
            if need > have:
                short[tier] = need - have
    return dataclasses.replace(s, fits=fits, shortfall_bytes=short)


def gb(n: int | float) -> float:
    """Bytes to GB (1e9), one decimal, as the plan prints them."""
    return math.floor(n / 1e8 + 0.5) / 10
