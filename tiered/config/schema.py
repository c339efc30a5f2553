"""The resolved configuration every component reads: frozen dataclasses, one per component.

`tiered.config.load_config` builds a `TieredConfig` from tiered's own JSON or an unchanged
DeepSpeed JSON; nothing else in the engine parses raw dicts. Sizes counted in elements (as
DeepSpeed counts them) end in `_numel`; sizes in bytes end in `_bytes`. Defaults are DeepSpeed's
code defaults (see shared reference, section 1.6), except where a comment says why not.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

OffloadDevice = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True)
class ParamOffloadConfig:
    """`zero_optimization.offload_param`: where the 16-bit parameter partitions live."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size_numel: int = 100_000_000
    max_in_cpu_numel: int = 1_000_000_000


@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """`zero_optimization.offload_optimizer`: where fp32 master, exp_avg, exp_avg_sq live."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4
    ratio: float = 1.0
    """Fraction of sub-groups whose Adam runs on the CPU (the rest stay on the GPU)."""
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    """Initialise NVMe optimizer state from the swapped 16-bit params (an init-speed choice)."""


@dataclass(frozen=True)
class AioConfig:
    """The `aio` section, with DeepSpeed's meanings, applied to the nvme backend."""

    block_size_bytes: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
    """GPUDirect Storage (cuFile); only valid where CUDA is available (checked by the loader)."""


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

    classes: tuple[str, ...] = DEFAULT_LEAF_CLASSES
    """Class names, bare (``MixtralSparseMoeBlock``) or dotted (``pkg.mod.Class``)."""
    names: tuple[str, ...] = ()
    """Qualified module names as ``model.named_modules()`` spells them ("" is the model itself)."""
    name_suffixes: tuple[str, ...] = ()
    """Suffixes of those names (``"moe"`` matches ``layers.0.moe``, ``layers.1.moe``...)."""

    @property
    def customized_classes(self) -> bool:
        return self.classes != DEFAULT_LEAF_CLASSES


@dataclass(frozen=True)
class ZeroConfig:
    """`zero_optimization`. Stages 1 and 2 run on the stage-3 machinery (see loader)."""

    stage: int = 3
    offload_param: ParamOffloadConfig = field(default_factory=ParamOffloadConfig)
    offload_optimizer: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    prefetch_bucket_size_numel: int = 50_000_000
    param_persistence_threshold_numel: int = 100_000
    model_persistence_threshold_numel: int = sys.maxsize
    max_live_parameters_numel: int = 1_000_000_000
    max_reuse_distance_numel: int = 1_000_000_000
    gather_16bit_weights_on_model_save: bool = False
    sub_group_size_numel: int = 1_000_000_000
    reduce_bucket_size_numel: int = 500_000_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    overlap_step_with_backward: bool = False
    """tiered's own: start a sub-group's step during backward (off by default)."""
    leaf_module: LeafModuleConfig = field(default_factory=LeafModuleConfig)


@dataclass(frozen=True)
class OptimizerConfig:
    """`optimizer`: Adam or AdamW (`adamw_mode` False means L2 weight decay, as torch Adam)."""

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    """DeepSpeed's FusedAdam and DeepSpeedCPUAdam default to 0, so a config without it means 0."""
    adamw_mode: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler`: WarmupLR, WarmupDecayLR or WarmupCosineLR with DeepSpeed's params."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrecisionConfig:
    """`bf16` / `fp16`: the dtype of parameters and gradients during compute."""

    dtype: torch.dtype = torch.float32
    loss_scale: float = 0.0
    """0 means dynamic loss scaling (fp16 only)."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False
    auto_cast: bool = False
    """fp16 only: cast floating-point inputs of the model's forward to fp16 (DeepSpeed's auto_cast)."""


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
    """Keyed by tier name: "gpu", "cpu", "nvme" (and any custom tier)."""
    trace_path: str | None = None
    """Write a Chrome-trace JSON of every move here on close."""
    timeout_s: float = 600.0
    """Longest any wait on the tier manager may take before TierTimeoutError."""
    io_threads: int = 8
    verify_checksums: bool = True
    """Checksum every partition written to a non-memory tier; verify it on every read back."""
    io_timeout_floor_s: float = 30.0
    """Each backend call may take io_timeout_floor_s + bytes / io_min_bytes_per_s (at most timeout_s)."""
    io_min_bytes_per_s: float = 50e6
    io_retries: int = 3
    """Tries again of a read or whole-object write that failed with a transient errno."""
    io_retry_backoff_s: float = 0.01
    io_retry_errnos: tuple[str, ...] = ("EAGAIN", "EINTR", "EBUSY", "ETIMEDOUT", "EIO")
    """The transient class: errno names retried."""
    param_tier: str | None = None
    """Tier holding offloaded 16-bit parameters ("cpu", "nvme", or a custom tier); None: no offload."""
    optimizer_tier: str | None = None
    """Tier holding offloaded optimizer state ("cpu", "nvme", "nvme_optimizer", custom); None: none."""
    grad_tier: str | None = None
    """Tier holding the fp32 gradients when the optimizer is offloaded (default "cpu"; "nvme":
    [Note: gradients on nvme]); None: the default."""
    host_mmap_threshold: int | None = 1 << 20
    """glibc's mmap threshold fixed at initialize, so freed partitions go back to the kernel
    ([Note: host allocations and glibc's heap]); None (``false`` in JSON): malloc left alone."""
    optimizer_state_format: str = "fp32"
    """How the offloaded Adam stores exp_avg / exp_avg_sq: "fp32" (exact), or opt-in compressed
    "bf16" / "int8" ([Note: compressed optimizer state]); the fp32 master is kept either way."""
    nonfinite_step: str | None = None
    """What a bf16/fp32 optimizer step whose loss or gradients hold NaN or inf does: "raise"
    (`NonFiniteError`), "skip" (a WARNING, counted in ``stats()["nonfinite_steps"]``) or "apply"
    (plain PyTorch's: the weights take the values); None: "raise". fp16 leaves it to the loss
    scaler. See [Note: non-finite steps] in tiered/engine/nonfinite.py."""
    check_collective_order: bool = True
    """With several ranks: before each gather and gradient reduction the ranks agree on which
    group it is, so ranks that diverge get `CollectiveOrderError` instead of a hang
    ([Note: collective order check] in tiered/zero/order.py)."""


@dataclass(frozen=True)
class TieredConfig:
    """Everything, resolved: every size a number; a hyper-parameter nobody gave is in `unset`."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    tiered: TieredSection = field(default_factory=TieredSection)
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    communication_data_type: str | None = None
    """dtype of gradient reduction across ranks ("fp32", "fp16", "bf16"); None: the compute dtype."""
    unset: tuple[str, ...] = ()
    """Key paths the config left to the caller ("auto", or "optimizer": no optimizer section) that
    nobody supplied; their fields hold placeholders nothing reads, and `tiered.initialize` refuses
    to train (see [Note: caller-supplied hyper-parameters] in config/hyper.py)."""
