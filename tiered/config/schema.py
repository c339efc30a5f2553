"""The resolved configuration every component reads: frozen dataclasses, one per component.

`tiered.config.load_config` builds a `TieredConfig` from tiered's own JSON or an unchanged
DeepSpeed JSON; nothing else in the engine parses raw dicts. Sizes counted in elements (as
DeepSpeed counts them) end in `_numel`; sizes in bytes end in `_bytes`. Defaults are DeepSpeed's
code defaults (deepspeed/runtime/zero/config.py, offload_config.py, swap_tensor/aio_config.py),
except where a doc line says why not.

Each field declares its config key with `key(default, path, doc)` ([Note: one declaration per
key] in declare.py): the parser, `dump_config`, the key table and docs/config.md follow from it.
To add a key: add its field here with `key(...)`, read it in the section's parser if it has rules
of its own (plain counts, numbers and flags are read by `read_key`), and regenerate the docs table
(``python -m tiered.config --markdown``; a test says when it is stale).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tiered.config.declare import key
from tiered.config.values import errno_codes

OffloadDevice = Literal["none", "cpu", "nvme"]

_ZP = "zero_optimization"
_OP = f"{_ZP}.offload_param"
_OO = f"{_ZP}.offload_optimizer"
_LM = f"{_ZP}.leaf_module"
_OPT = "optimizer.params"


@dataclass(frozen=True)
class ParamOffloadConfig:
    """`zero_optimization.offload_param`: where the 16-bit parameter partitions live."""

    device: OffloadDevice = key(
        "none", f"{_OP}.device", "none / cpu / nvme: where 16-bit parameter partitions live"
    )
    nvme_path: str | None = key(
        None,
        f"{_OP}.nvme_path",
        "directory of the nvme tier (created when the engine opens it; must be writable)",
    )
    pin_memory: bool = key(True, f"{_OP}.pin_memory", "false makes the cpu tier pageable")
    buffer_count: int = key(
        5,
        f"{_OP}.buffer_count",
        "tiered has no fixed pool of parameter swap buffers: the gpu tier's budget and "
        "stage3_max_live_parameters bound what is gathered",
        kind="accepted",
        minimum=1,
    )
    buffer_size_numel: int = key(
        100_000_000,
        f"{_OP}.buffer_size",
        "tiered moves each shard group in a buffer of its own size, so no parameter is too large for a pool",
        kind="accepted",
        minimum=1,
    )
    max_in_cpu_numel: int = key(
        1_000_000_000, f"{_OP}.max_in_cpu", "with NVMe params: elements kept in CPU memory", minimum=0
    )


@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """`zero_optimization.offload_optimizer`: where fp32 master, exp_avg, exp_avg_sq live."""

    device: OffloadDevice = key(
        "none", f"{_OO}.device", "none / cpu / nvme: where fp32 master, exp_avg, exp_avg_sq live"
    )
    nvme_path: str | None = key(
        None, f"{_OO}.nvme_path", "directory of the optimizer's nvme tier (its own tier when it differs)"
    )
    pin_memory: bool = key(True, f"{_OO}.pin_memory", "false makes the cpu tier pageable")
    buffer_count: int = key(
        4, f"{_OO}.buffer_count", "optimizer tiles in flight in the step pipeline", minimum=1
    )
    ratio: float = key(
        1.0,
        f"{_OO}.ratio",
        "Twin-Flow: fraction of groups whose Adam runs on the CPU (the rest stay on the GPU)",
        minimum=0.0,
        maximum=1.0,
        min_exclusive=True,
    )
    pipeline_read: bool = key(
        False, f"{_OO}.pipeline_read", "prefetch every group's optimizer state before the step"
    )
    pipeline_write: bool = key(False, f"{_OO}.pipeline_write", "write-backs not bounded by buffer_count")
    fast_init: bool = key(
        False,
        f"{_OO}.fast_init",
        "tiered writes the initial optimizer state from the fp32 shards directly; an init-speed choice",
        kind="accepted",
    )


AIO_MAX_BLOCK_BYTES = 1 << 30
"""Ceiling of aio.block_size * aio.queue_depth: the nvme backend stages a chunk that large per I/O call."""


@dataclass(frozen=True)
class AioConfig:
    """The `aio` section, with DeepSpeed's meanings, applied to the nvme backend."""

    block_size_bytes: int = key(
        1_048_576,
        "aio.block_size",
        "nvme backend block size, in bytes (block_size * queue_depth at most 1 GiB)",
        minimum=1,
    )
    queue_depth: int = key(8, "aio.queue_depth", "nvme backend queue depth", minimum=1)
    thread_count: int = key(
        1, "aio.thread_count", "nvme backend I/O threads", aliases=("intra_op_parallelism",), minimum=1
    )
    single_submit: bool = key(
        False,
        "aio.single_submit",
        "tiered's nvme backend has no submission queue to configure",
        kind="accepted",
    )
    overlap_events: bool = key(
        True,
        "aio.overlap_events",
        "tiered's nvme backend has no submission queue to configure",
        kind="accepted",
    )
    use_gds: bool = key(
        False, "aio.use_gds", "GPUDirect Storage (cuFile); refused where CUDA is not available"
    )


DEFAULT_LEAF_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed's default `zero_optimization.leaf_module.classes` (kept, so an unchanged config means the same)."""


@dataclass(frozen=True)
class LeafModuleConfig:
    """`zero_optimization.leaf_module`: the modules whose whole subtree is gathered on entry and
    reduced at its backward boundary ([Note: leaf modules] in tiered/zero/leaf.py)."""

    classes: tuple[str, ...] = key(
        DEFAULT_LEAF_CLASSES,
        f"{_LM}.classes",
        "class names, bare or dotted; absent: DeepSpeed's defaults (Mixtral's, Qwen2-MoE's and "
        "Qwen3-MoE's sparse MoE blocks); `[]`: none",
    )
    names: tuple[str, ...] = key(
        (),
        f"{_LM}.names",
        'module names as `model.named_modules()` spells them (`""`: the model itself); each must exist',
    )
    name_suffixes: tuple[str, ...] = key(
        (),
        f"{_LM}.name_suffixes",
        'suffixes of those names (`"moe"` matches `layers.0.moe`, `layers.1.moe`, ...); each must match',
    )

    @property
    def customized_classes(self) -> bool:
        return self.classes != DEFAULT_LEAF_CLASSES


@dataclass(frozen=True)
class ZeroConfig:
    """`zero_optimization`. Stages 0, 1 and 2 run on the stage-3 machinery ([Note: key
    classification] in keys.py); the stage decides DeepSpeed's stage rules and defaults."""

    stage: int = key(
        0, f"{_ZP}.stage", "0-3; all run on the partitioned machinery, DeepSpeed's stage rules enforced"
    )
    offload_param: ParamOffloadConfig = field(default_factory=ParamOffloadConfig)
    offload_optimizer: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    prefetch_bucket_size_numel: int = key(
        50_000_000,
        f"{_ZP}.stage3_prefetch_bucket_size",
        "elements prefetched ahead (0: no prefetch); DeepSpeed's code default 5e7, not its docs' 5e8",
        aliases=("prefetch_bucket_size",),
        auto="model",
    )
    param_persistence_threshold_numel: int = key(
        100_000,
        f"{_ZP}.stage3_param_persistence_threshold",
        "parameters this small stay gathered",
        aliases=("param_persistence_threshold",),
        auto="model",
    )
    model_persistence_threshold_numel: int = key(
        sys.maxsize,
        f"{_ZP}.stage3_model_persistence_threshold",
        "cap on the total elements kept persistent",
        aliases=("model_persistence_threshold",),
    )
    max_live_parameters_numel: int = key(
        1_000_000_000,
        f"{_ZP}.stage3_max_live_parameters",
        "hard cap on gathered elements (0: DeepSpeed's 'no prefetch', no cap)",
        aliases=("max_live_parameters",),
    )
    max_reuse_distance_numel: int = key(
        1_000_000_000,
        f"{_ZP}.stage3_max_reuse_distance",
        "keep a released group if reused within N elements (0: release at once)",
        aliases=("max_reuse_distance",),
    )
    gather_16bit_weights_on_model_save: bool = key(
        False,
        f"{_ZP}.stage3_gather_16bit_weights_on_model_save",
        "tiered has no save_16bit_model(); engine.zero.gather_full_state_dict() always returns full weights",
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),
        kind="accepted",
    )
    sub_group_size_numel: int = key(
        1_000_000_000,
        f"{_ZP}.sub_group_size",
        "elements per shard group (0: one parameter per group, as DeepSpeed); also the optimizer "
        "step's tile, at least 65536 elements, for a group whose states are staged ([Note: sub-group "
        "pipeline])",
    )
    reduce_bucket_size_numel: int = key(
        500_000_000,
        f"{_ZP}.reduce_bucket_size",
        "tiered reduces each shard group's gradient as soon as its backward ends; it has no bucket to size",
        kind="accepted",
        auto="model",
    )
    overlap_comm: bool | None = key(
        None,
        f"{_ZP}.overlap_comm",
        "tiered's gathers, prefetches and write-backs always run on its tier loop, beside compute; in "
        "DeepSpeed the flag picks CUDA streams, not results",
        kind="accepted",
        default_doc="true for stage 3, else false (DeepSpeed's)",
    )
    """None (not given) becomes DeepSpeed's default on construction: true for stage 3 only."""
    contiguous_gradients: bool = key(
        True,
        f"{_ZP}.contiguous_gradients",
        "tiered writes every gradient straight into its flat partition buffer (always contiguous)",
        kind="accepted",
    )
    overlap_step_with_backward: bool = key(
        False,
        "tiered.overlap_step_with_backward",
        "start each group's step during backward (tiered's own; without accumulation, a gradient "
        "on nvme is stepped from memory: [Note: gradient consumed from memory])",
    )
    leaf_module: LeafModuleConfig = field(default_factory=LeafModuleConfig)

    def __post_init__(self) -> None:
        if self.overlap_comm is None:  # DeepSpeed's overlap_comm_valid: None -> stage == 3
            object.__setattr__(self, "overlap_comm", self.stage == 3)


@dataclass(frozen=True)
class OptimizerConfig:
    """`optimizer`: Adam or AdamW (`adamw_mode` False means L2 weight decay, as torch Adam)."""

    type: str = key("AdamW", "optimizer.type", "Adam or AdamW (any case); other optimizers refused by name")
    lr: float = key(
        1e-3, f"{_OPT}.lr", 'the lr; "auto" or missing: lr= (never invented)', auto="caller", minimum=0.0
    )
    betas: tuple[float, float] = key(
        (0.9, 0.999), f"{_OPT}.betas", 'Adam betas; "auto": betas=', auto="caller"
    )
    eps: float = key(
        1e-8,
        f"{_OPT}.eps",
        'Adam eps, > 0 (0 divides by zero where a second moment is 0); "auto": eps=',
        auto="caller",
        minimum=0.0,
        min_exclusive=True,
    )
    weight_decay: float = key(
        0.0,
        f"{_OPT}.weight_decay",
        "decoupled (AdamW) or L2 (Adam, adam_w_mode false); DeepSpeed's FusedAdam and CPUAdam default "
        "to 0 as well (with torch_adam true, torch.optim.AdamW's 0.01); "
        '"auto": weight_decay=',
        auto="caller",
        minimum=0.0,
    )
    adamw_mode: bool = key(True, f"{_OPT}.adam_w_mode", "false with type Adam: L2 weight decay (torch Adam)")


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler`: WarmupLR, WarmupDecayLR or WarmupCosineLR with DeepSpeed's params."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrecisionConfig:
    """`bf16` / `fp16`: the dtype of parameters and gradients during compute."""

    dtype: torch.dtype = torch.float32
    """From bf16.enabled / fp16.enabled (two keys, one field; see keys.py)."""
    loss_scale: float = key(0.0, "fp16.loss_scale", "0: dynamic loss scaling; > 0: static scale", minimum=0.0)
    initial_scale_power: int = key(16, "fp16.initial_scale_power", "dynamic scale starts at 2**N", minimum=0)
    loss_scale_window: int = key(
        1000, "fp16.loss_scale_window", "steps without overflow before the scale doubles", minimum=1
    )
    hysteresis: int = key(2, "fp16.hysteresis", "overflows tolerated before the scale halves", minimum=1)
    min_loss_scale: float = key(
        1.0, "fp16.min_loss_scale", "floor of the dynamic scale", minimum=0.0, min_exclusive=True
    )
    consecutive_hysteresis: bool = key(
        False, "fp16.consecutive_hysteresis", "reset hysteresis after a good step"
    )
    auto_cast: bool = key(
        False, "fp16.auto_cast", "cast the forward's floating-point inputs to fp16, as DeepSpeed does"
    )
    check_grad_overflow: bool = key(
        False,
        "bf16.check_grad_overflow",
        "true: a bf16 step whose loss or gradients hold NaN or inf is skipped, as DeepSpeed does "
        '(`tiered.nonfinite_step` "skip", which takes precedence where set); false: tiered\'s own '
        "default, `tiered.nonfinite_step` ([Note: non-finite steps])",
    )


@dataclass(frozen=True)
class TierSpec:
    """One tier under `"tiered": {"tiers": {...}}`: a backend spec and a hard byte budget."""

    backend: dict[str, Any]
    budget_bytes: int | None = None
    """None means: as much as the backend reports free."""


OPTIMIZER_STATE_FORMATS = ("fp32", "bf16", "int8")
"""The values of ``tiered.optimizer_state_format`` ([Note: compressed optimizer state] in
tiered/optim/state_format.py, whose codecs these names select)."""


@dataclass(frozen=True)
class TieredSection:
    """The engine's own keys, under `"tiered"`."""

    tiers: dict[str, TierSpec] = field(default_factory=dict)
    """Keyed by tier name: "gpu", "cpu", "nvme" (and any custom tier); the `tiered.tiers` section."""
    trace_path: str | None = key(
        None, "tiered.trace_path", "Chrome trace of every move, written on close", auto="refused"
    )
    timeout_s: float = key(
        600.0,
        "tiered.timeout_s",
        "longest wait of one tier-manager request (fetch, prefetch, evict, flush; all its inner waits "
        "share it) and of `close()` (the backends close at once, each within it), before "
        "TierTimeoutError naming the backend and tier: [Waits, hangs and shared folders]"
        "(#waits-hangs-and-shared-folders)",
        auto="refused",
        minimum=0.0,
        min_exclusive=True,
    )
    io_threads: int = key(8, "tiered.io_threads", "tier manager I/O threads", auto="refused", minimum=1)
    verify_checksums: bool = key(
        True,
        "tiered.verify_checksums",
        "xxh3 checksum per partition written to a non-memory tier, verified on every read",
        auto="refused",
    )
    io_timeout_floor_s: float = key(
        30.0,
        "tiered.io_timeout_floor_s",
        "each backend call may take this + bytes / `io_min_bytes_per_s`, at most `timeout_s`",
        auto="refused",
        minimum=0.0,
        min_exclusive=True,
    )
    io_min_bytes_per_s: float = key(
        50e6,
        "tiered.io_min_bytes_per_s",
        "slowest bandwidth a working backend delivers",
        auto="refused",
        minimum=0.0,
        min_exclusive=True,
    )
    io_retries: int = key(
        3,
        "tiered.io_retries",
        "retries of a read or whole-object write that failed with a transient errno",
        auto="refused",
        minimum=0,
    )
    io_retry_backoff_s: float = key(
        0.01,
        "tiered.io_retry_backoff_s",
        "first backoff between retries, doubled each time, at most 1 s",
        auto="refused",
        minimum=0.0,
    )
    io_retry_errnos: tuple[str, ...] = key(
        ("EAGAIN", "EINTR", "EBUSY", "ETIMEDOUT", "EIO"),
        "tiered.io_retry_errnos",
        "the transient class: errno names retried",
        auto="refused",
    )
    param_tier: str | None = key(
        None,
        "tiered.param_tier",
        'tier of offloaded parameters ("cpu", "nvme", or a custom tier); null: from offload_param.device',
        auto="refused",
    )
    optimizer_tier: str | None = key(
        None,
        "tiered.optimizer_tier",
        'tier of offloaded optimizer state ("cpu", "nvme", "nvme_optimizer", custom); null: from '
        "offload_optimizer.device",
        auto="refused",
    )
    grad_tier: str | None = key(
        None,
        "tiered.grad_tier",
        "tier of the fp32 gradients when the optimizer is offloaded (null: `cpu`; `nvme`: one group "
        "staged in host memory at a time, [Note: gradients on nvme])",
        auto="refused",
    )
    host_mmap_threshold: int | None = key(
        1 << 20,
        "tiered.host_mmap_threshold",
        "at initialize glibc's mmap threshold is fixed at this size (4 KiB .. 32 MiB), so freed "
        "partitions and staging buffers go back to the kernel and the host memory stays near the tier "
        "budgets ([Note: host allocations and glibc's heap]); `false` leaves malloc alone, as does "
        "`MALLOC_MMAP_THRESHOLD_` in the environment or a C library other than glibc",
        auto="refused",
    )
    optimizer_state_format: str = key(
        "fp32",
        "tiered.optimizer_state_format",
        'how Adam\'s exp_avg / exp_avg_sq are stored: `"fp32"` (exact); `"bf16"` (stochastic '
        'rounding, 8 B of state per parameter instead of 12) and `"int8"` (block-wise 8-bit log '
        "codes, exp_avg_sq in the sqrt domain, 6.03 B) are opt-in codecs with stated error ([Note: "
        "compressed optimizer state] in `tiered/optim/state_format.py`), Adam/AdamW only; their "
        "stochastic rounding draws no random stream: its noise is a hash of the step, the moment, the "
        "group and each element's index ([Note: counter-based rounding noise] in "
        "`tiered/optim/rounding_noise.py`), so a resumed run rounds as the uninterrupted one on any "
        "thread count, tile size or world size; the codecs run as native kernels built with the CPU "
        "Adam (the same bits in torch where the build is unavailable); an unknown name is a "
        "`ConfigError` listing the formats. The compressed formats need the state offloaded "
        "(offload_optimizer.device cpu or nvme, ratio 1); their checkpoints load into a run of the "
        "same format (int8: the same layout) or into an fp32 one, decoded exactly on any layout; "
        "fp32 into bf16/int8 and bf16 <-> int8 are refused (lossy)",
        auto="refused",
    )
    nonfinite_step: str | None = key(
        None,
        "tiered.nonfinite_step",
        'what a bf16/fp32 optimizer step whose loss or gradients hold NaN or inf does: `"raise"` '
        '(`NonFiniteError` naming the step and the first non-finite group), `"skip"` (a WARNING, '
        'counted in `stats()["nonfinite_steps"]`) or `"apply"` (plain PyTorch\'s: the weights take '
        'the values); null: `"raise"`; with fp16 the loss scaler decides and setting it is refused '
        "([Note: non-finite steps] in tiered/engine/nonfinite.py)",
        auto="refused",
    )
    residency: str = key(
        "auto",
        "tiered.residency",
        '`"auto"`: the faster tiers keep, across steps, the partitions homed below them that their '
        "budgets have room for, chosen by bytes saved per step per byte held, so memory given becomes "
        "fewer bytes moved (a tier without a budget lends what its backend reports free, less a "
        '10 % / 2 GiB reserve); `"host"`: only the host-memory tiers keep (the room of a gpu budget beyond '
        "its need is left to the activations: what `tiered plan` writes where their memory is not known); "
        '`"off"`: only DeepSpeed\'s own `offload_param.max_in_cpu` keep. The '
        "values trained are the same either way ([Note: residency] in tiered/planning/residency.py)",
        auto="refused",
    )
    check_collective_order: bool = key(
        True,
        "tiered.check_collective_order",
        "with several ranks, the ranks agree on each gather and gradient reduction before issuing it, "
        "so diverging graphs raise `CollectiveOrderError` naming the leaf module to declare instead of "
        "hanging ([Note: collective order check] in tiered/zero/order.py); false saves one small host "
        "collective each",
        auto="refused",
    )
    io_retry_errno_codes: frozenset[int] = field(init=False, repr=False, compare=False)
    """`io_retry_errnos` as errno codes, resolved once on construction."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "io_retry_errno_codes", errno_codes(self.io_retry_errnos, "tiered.io_retry_errnos")
        )


@dataclass(frozen=True)
class TieredConfig:
    """Everything, resolved: every size a number; a hyper-parameter nobody gave is in `unset`."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    """The `scheduler` section (None: constant lr); its params are checked per type in scheduler.py."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    tiered: TieredSection = field(default_factory=TieredSection)
    gradient_accumulation_steps: int = key(
        1,
        "gradient_accumulation_steps",
        'engine.step() steps every N micro-batches; backward divides the loss by N; "auto": '
        "gradient_accumulation_steps=",
        auto="caller",
        minimum=1,
    )
    gradient_clipping: float = key(
        0.0,
        "gradient_clipping",
        'global-norm clipping before the step (0: off); "auto": max_grad_norm=',
        auto="caller",
        minimum=0.0,
    )
    train_batch_size: int | None = key(
        None,
        "train_batch_size",
        'DeepSpeed\'s batch identity train = micro * accumulation * world size; derived when "auto"',
        minimum=1,
    )
    train_micro_batch_size_per_gpu: int | None = key(
        None,
        "train_micro_batch_size_per_gpu",
        'recorded (the engine takes whatever micro-batch you feed it); "auto": micro_batch_size=',
        auto="caller",
        minimum=1,
    )
    steps_per_print: int = key(
        10, "steps_per_print", "the engine logs step, lr, loss scale, grad norm every N steps", minimum=1
    )
    wall_clock_breakdown: bool = key(
        False, "wall_clock_breakdown", "adds forward/backward/step seconds to that line"
    )
    dataloader_drop_last: bool = key(
        False,
        "dataloader_drop_last",
        "the loader initialize builds from training_data drops each pass's last, short micro-batch",
    )
    communication_data_type: str | None = key(
        None,
        "communication_data_type",
        "tiered reduces each gradient across ranks in the dtype it is produced in (DeepSpeed's "
        "behaviour when the key is unset); on one process there is no reduction",
        kind="accepted",
    )
    unset: tuple[str, ...] = ()
    """Key paths the config left to the caller ("auto", or "optimizer": no optimizer section) that
    nobody supplied; their fields hold placeholders nothing reads, and `tiered.initialize` refuses
    to train (see [Note: caller-supplied hyper-parameters] in config/hyper.py)."""
