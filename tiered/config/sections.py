"""Readers for the DeepSpeed sections: zero_optimization (+ offload), aio, optimizer, precision.

Each reader takes the raw (already key-checked, see keys.py) JSON object and returns the frozen
schema dataclass. Defaults are DeepSpeed's code defaults (shared reference, sections 1.6 and
3.4); "auto" on a key the model does not determine means that default.

aio.thread_count: DeepSpeed renamed it intra_op_parallelism (PR #7056) and its current parser
silently ignores the old name; tiered honours both spellings (one setting, error if both).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, cast

import torch

from tiered.config.keys import check_section
from tiered.config.read import pick, read_key, read_keys
from tiered.config.schema import (
    AIO_MAX_BLOCK_BYTES,
    AioConfig,
    LeafModuleConfig,
    OffloadDevice,
    OptimizerConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
    PrecisionConfig,
    ZeroConfig,
)
from tiered.config.values import (
    as_betas,
    as_bool,
    as_choice,
    as_count,
    as_section,
    as_str,
    is_auto,
)
from tiered.errors import ConfigError, UnsupportedConfigError

log = logging.getLogger(__name__)

ZP = "zero_optimization"
TORCH_ADAMW_WEIGHT_DECAY = 0.01
"""torch.optim.AdamW's default weight_decay: what DeepSpeed's optimizer.params.torch_adam runs with."""
_DEVICES = ("none", "cpu", "nvme")
_DS_OPTIMIZERS = (
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    "Lamb",
    "Lion",
    "Adagrad",
    "SGD",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
    "Muon",
    "FusedAdam",
    "CPUAdam",
    "DeepSpeedCPUAdam",
    "Adam8bit",
)


def _flag(section: dict[str, Any], prefix: str, key: str, default: bool) -> bool:
    """A flag that sets no field of its own (the deprecated cpu_offload* aliases, enabled)."""
    if key not in section or section[key] is None or is_auto(section[key]):
        return default
    return as_bool(section[key], f"{prefix}.{key}")


def check_nvme_path(value: Any, path: str) -> str:
    """Validate an nvme_path without touching the disk: an existing path must be a writable
    directory, a missing one must be creatable (its nearest existing ancestor a directory this user
    can write). Errors name the key and the path.

    Parsing creates nothing ([Note: config parsing is pure]): the nvme backend creates the folder
    when it opens it (the derived tier's ``"create": true``, tiered/config/tiers.py), as DeepSpeed's
    swapper makedirs its folder, so a config that is refused, or only weighed by the planner, or
    puts nothing on NVMe, leaves no folder behind."""
    text = as_str(value, path)
    target = os.path.abspath(os.path.expanduser(text))
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ConfigError(f"{path} = {text!r} is not a directory; point it at a directory on an NVMe drive")
    existing = target
    while not os.path.lexists(existing):  # the folder the backend's mkdir will create under
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{path} = {text!r}: cannot create the directory ({existing} is not a directory); "
            "point it at a directory on a local NVMe drive that you can write"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        if os.statvfs(existing).f_flag & os.ST_RDONLY:  # not a mode: no chmod would help
            raise ConfigError(
                f"{path} = {text!r} is on a read-only filesystem; remount it read-write or point it "
                "at a directory on a writable drive"
            )
        what = "is not writable" if existing == target else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"{path} = {text!r} {what} by this user; fix its permissions or choose another")
    return text


def _device(section: dict[str, Any], prefix: str) -> OffloadDevice:
    value = section.get("device", "none")
    return "none" if value is None else cast(OffloadDevice, as_choice(value, f"{prefix}.device", _DEVICES))


def _offload_common(raw: Any, prefix: str) -> tuple[dict[str, Any], OffloadDevice, str | None]:
    """The checked section, its device and its nvme_path (required, and checked, for nvme)."""
    section = as_section(raw if raw is not None else {}, prefix)
    check_section(section, prefix)
    device = _device(section, prefix)
    nvme_path = section.get("nvme_path")
    if device == "nvme":
        if nvme_path is None:
            raise ConfigError(
                f'{prefix}.device is "nvme" but {prefix}.nvme_path is not set; give a directory on an NVMe drive'
            )
        nvme_path = check_nvme_path(nvme_path, f"{prefix}.nvme_path")
    elif nvme_path is not None:
        nvme_path = as_str(nvme_path, f"{prefix}.nvme_path")
    return section, device, nvme_path


def parse_offload_param(raw: Any, prefix: str, pin_default: bool) -> ParamOffloadConfig:
    section, device, nvme_path = _offload_common(raw, prefix)
    c = ParamOffloadConfig
    return c(
        device=device,
        nvme_path=nvme_path,
        pin_memory=read_key(section, c, "pin_memory", default=pin_default),
        **read_keys(section, c, "buffer_count", "buffer_size_numel", "max_in_cpu_numel"),
    )


def parse_offload_optimizer(raw: Any, prefix: str, pin_default: bool) -> OptimizerOffloadConfig:
    section, device, nvme_path = _offload_common(raw, prefix)
    c = OptimizerOffloadConfig
    return c(
        device=device,
        nvme_path=nvme_path,
        pin_memory=read_key(section, c, "pin_memory", default=pin_default),
        **read_keys(section, c, "buffer_count", "ratio", "pipeline_read", "pipeline_write", "fast_init"),
    )


def parse_zero(raw: Any, model: torch.nn.Module | None) -> ZeroConfig:
    section = as_section(raw if raw is not None else {}, ZP)
    check_section(section, ZP)
    stage: int = ZeroConfig.stage
    if "stage" in section and not is_auto(section["stage"]):
        stage = as_count(section["stage"], f"{ZP}.stage")
        if stage > 3:
            raise ConfigError(f"{ZP}.stage = {section['stage']!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    pin_default = _flag(section, ZP, "cpu_offload_use_pin_memory", True)

    opt_raw = section.get("offload_optimizer")
    if _flag(section, ZP, "cpu_offload", False):
        if (
            opt_raw is not None
            and _device(as_section(opt_raw, f"{ZP}.offload_optimizer"), f"{ZP}.offload_optimizer") != "cpu"
        ):
            raise ConfigError(
                f'{ZP}.cpu_offload is true but {ZP}.offload_optimizer.device is not "cpu"; keep only offload_optimizer'
            )
        opt_raw = {**(opt_raw or {}), "device": "cpu"}
    param_raw = section.get("offload_param")
    if _flag(section, ZP, "cpu_offload_param", False):
        if (
            param_raw is not None
            and _device(as_section(param_raw, f"{ZP}.offload_param"), f"{ZP}.offload_param") != "cpu"
        ):
            raise ConfigError(
                f'{ZP}.cpu_offload_param is true but {ZP}.offload_param.device is not "cpu"; keep only offload_param'
            )
        param_raw = {**(param_raw or {}), "device": "cpu"}
    offload_param = parse_offload_param(param_raw, f"{ZP}.offload_param", pin_default)
    offload_opt = parse_offload_optimizer(opt_raw, f"{ZP}.offload_optimizer", pin_default)

    # DeepSpeed's stage rules (offload_config.py, config.py), kept so a config that DeepSpeed
    # rejects is rejected here too, even though tiered could run it.
    if offload_param.device != "none" and stage != 3:
        raise ConfigError(
            f"{ZP}.offload_param.device = {offload_param.device!r} needs {ZP}.stage 3 (got {stage}), as in "
            f'DeepSpeed; set "stage": 3 or remove offload_param'
        )
    if offload_opt.device != "none" and stage == 0:
        raise ConfigError(
            f"{ZP}.offload_optimizer needs {ZP}.stage 1, 2 or 3 (got 0); set a stage or remove offload_optimizer"
        )
    if offload_opt.device == "nvme" and stage != 3:
        raise ConfigError(
            f'{ZP}.offload_optimizer.device "nvme" needs {ZP}.stage 3 (got {stage}), as in DeepSpeed'
        )
    if offload_opt.ratio < 1.0 and stage != 3:
        raise ConfigError(
            f"{ZP}.offload_optimizer.ratio < 1 needs {ZP}.stage 3 (got {stage}), as in DeepSpeed"
        )

    # [Note: zeros keep DeepSpeed's meaning]
    # sub_group_size 0: DeepSpeed closes a sub-group once its size >= 0, i.e. after every
    # parameter (stage3.py _create_fp16_sub_groups); tiered's groups never split a parameter, so
    # 1 element means the same: one parameter per group. stage3_max_live_parameters limits only
    # prefetch in DeepSpeed (partitioned_param_coordinator.py): 0 means no prefetch and no cap on
    # the fetch a module needs. tiered's budget is a hard cap including that fetch, so 0 becomes
    # prefetch off and no cap. stage3_prefetch_bucket_size 0 (no prefetch) and
    # stage3_max_reuse_distance 0 (release at once) mean the same in tiered as written.
    z = ZeroConfig
    prefetch = read_key(section, z, "prefetch_bucket_size_numel", model)
    max_live = read_key(section, z, "max_live_parameters_numel")
    if max_live == 0:
        log.info(
            "%s.stage3_max_live_parameters 0: as in DeepSpeed, no prefetch and no cap on a module's fetch", ZP
        )
        prefetch, max_live = 0, sys.maxsize
    return ZeroConfig(
        stage=stage,
        offload_param=offload_param,
        offload_optimizer=offload_opt,
        prefetch_bucket_size_numel=prefetch,
        param_persistence_threshold_numel=read_key(section, z, "param_persistence_threshold_numel", model),
        model_persistence_threshold_numel=read_key(section, z, "model_persistence_threshold_numel"),
        max_live_parameters_numel=max_live,
        max_reuse_distance_numel=read_key(section, z, "max_reuse_distance_numel"),
        gather_16bit_weights_on_model_save=read_key(section, z, "gather_16bit_weights_on_model_save"),
        sub_group_size_numel=max(1, read_key(section, z, "sub_group_size_numel")),
        reduce_bucket_size_numel=read_key(section, z, "reduce_bucket_size_numel", model),
        overlap_comm=read_key(section, z, "overlap_comm"),  # None: DeepSpeed's stage-3-only default
        contiguous_gradients=read_key(section, z, "contiguous_gradients"),
        leaf_module=parse_leaf_module(section.get("leaf_module")),
    )


def parse_leaf_module(raw: Any) -> LeafModuleConfig:
    """`zero_optimization.leaf_module`, as DeepSpeed reads it: each of classes / names /
    name_suffixes a list of strings (a single string is one entry); classes absent means
    DeepSpeed's default classes, an empty list none."""
    prefix = f"{ZP}.leaf_module"
    section = as_section(raw if raw is not None else {}, prefix)
    check_section(section, prefix)
    found: dict[str, tuple[str, ...]] = {}
    for key in ("classes", "names", "name_suffixes"):
        value = section.get(key)
        if value is None:
            continue
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{prefix}.{key}: expected a list of strings, got {value!r}")
        if key != "names" and any(not v.strip() for v in items):
            raise ConfigError(f"{prefix}.{key}: {value!r} has an empty entry, which would match every module")
        found[key] = tuple(dict.fromkeys(items))  # DeepSpeed drops duplicates, keeping the order
    return LeafModuleConfig(**found)


def parse_aio(raw: Any) -> AioConfig:
    section = as_section(raw if raw is not None else {}, "aio")
    check_section(section, "aio")
    use_gds = read_key(section, AioConfig, "use_gds")
    if use_gds and not torch.cuda.is_available():
        raise UnsupportedConfigError(
            "aio.use_gds is true but CUDA is not available here; GPUDirect Storage needs a CUDA GPU "
            'and cuFile. Set "use_gds": false'
        )
    a = AioConfig
    block, depth = read_key(section, a, "block_size_bytes"), read_key(section, a, "queue_depth")
    if block * depth > AIO_MAX_BLOCK_BYTES:
        # the nvme backend stages one chunk of block_size * queue_depth bytes per I/O call
        # ([Note: DeepSpeed aio knobs] in the nvme backend): refuse it here, by name, rather than
        # as an allocation failure at the first move
        raise ConfigError(
            f"aio.block_size ({block}) * aio.queue_depth ({depth}) = {block * depth} bytes is the "
            f"nvme backend's staging chunk per I/O call, above its limit of {AIO_MAX_BLOCK_BYTES} (1 GiB); "
            "use DeepSpeed's usual sizes (block_size 1048576, queue_depth 8)"
        )
    return AioConfig(
        block_size_bytes=block,
        queue_depth=depth,
        use_gds=use_gds,
        **read_keys(section, a, "thread_count", "single_submit", "overlap_events"),
    )


def optimizer_type(value: Any) -> str:
    """ "Adam" or "AdamW" (any case); every other optimizer is UnsupportedConfigError."""
    if isinstance(value, str):
        for name in ("Adam", "AdamW"):
            if value.strip().lower() == name.lower():
                return name
        known = next((n for n in _DS_OPTIMIZERS if n.lower() == value.strip().lower()), None)
        if known:
            raise UnsupportedConfigError(
                f"optimizer.type = {value!r} is a DeepSpeed optimizer tiered does not support; "
                'tiered offloads Adam and AdamW only: use "Adam" or "AdamW"'
            )
    raise UnsupportedConfigError(
        f'optimizer.type = {value!r} is not supported; tiered offloads Adam and AdamW only: use "Adam" or "AdamW"'
    )


def parse_optimizer(raw: Any) -> OptimizerConfig:
    if raw is None:
        return OptimizerConfig()
    section = as_section(raw, "optimizer")
    check_section(section, "optimizer")
    if "type" not in section:
        raise ConfigError('optimizer.type is missing; set "Adam" or "AdamW"')
    type_ = optimizer_type(section["type"])
    params = as_section(section.get("params") or {}, "optimizer.params")
    check_section(params, "optimizer.params")
    p = "optimizer.params"
    defaults = OptimizerConfig()

    def value(key: str) -> Any:
        v = params.get(key)
        return None if v is None or is_auto(v) else v

    adam_w_mode = value("adam_w_mode")
    adam_w_mode = defaults.adamw_mode if adam_w_mode is None else as_bool(adam_w_mode, f"{p}.adam_w_mode")
    if type_ == "AdamW" and not adam_w_mode:
        raise ConfigError(
            f'{p}.adam_w_mode is false but optimizer.type is "AdamW" (DeepSpeed would silently run AdamW); '
            'use "type": "Adam" with adam_w_mode false for L2 weight decay'
        )
    o = OptimizerConfig
    betas = value("betas")
    torch_adam = value("torch_adam")
    # With torch_adam DeepSpeed builds torch.optim.AdamW (Adam with adam_w_mode false: torch.optim.Adam)
    # from the params as given, so a weight_decay left out is torch AdamW's default, not FusedAdam's 0.
    torch_adamw = adam_w_mode and torch_adam is not None and as_bool(torch_adam, f"{p}.torch_adam")
    return OptimizerConfig(
        type=type_,
        lr=read_key(params, o, "lr"),
        betas=defaults.betas if betas is None else as_betas(betas, f"{p}.betas"),
        eps=read_key(params, o, "eps"),
        weight_decay=read_key(
            params,
            o,
            "weight_decay",
            default=TORCH_ADAMW_WEIGHT_DECAY if torch_adamw else dataclasses.MISSING,
        ),
        # DeepSpeed: effective adam_w_mode = (type == AdamW) or adam_w_mode (default True).
        adamw_mode=adam_w_mode,
    )


def parse_precision(config: dict[str, Any]) -> PrecisionConfig:
    bf16_found = pick(config, "", ("bf16", "bfloat16"))
    bf16_on = False
    check_grad_overflow = False
    if bf16_found is not None and bf16_found[1] is not None:  # null: absent, as DeepSpeed reads it
        key, raw = bf16_found
        section = as_section(raw, key)
        check_section(section, "bf16")
        bf16_on = _flag(section, key, "enabled", False)
        check_grad_overflow = read_key(section, PrecisionConfig, "check_grad_overflow")
    fp16 = as_section(config.get("fp16") or {}, "fp16")
    check_section(fp16, "fp16")
    fp16_on = _flag(fp16, "fp16", "enabled", False)
    if bf16_on and fp16_on:
        raise ConfigError("bf16.enabled and fp16.enabled are both true; enable only one of them")
    c = PrecisionConfig
    return PrecisionConfig(
        dtype=torch.bfloat16 if bf16_on else torch.float16 if fp16_on else torch.float32,
        **read_keys(
            fp16,
            c,
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "min_loss_scale",
            "consecutive_hysteresis",
            "auto_cast",
        ),
        check_grad_overflow=check_grad_overflow,
    )
