"""Readers for the DeepSpeed sections: zero_optimization (+ offload), aio, optimizer, precision.

Each reader takes the raw (already key-checked, see keys.py) JSON object and returns the frozen
schema dataclass. Defaults are DeepSpeed's code defaults (shared reference, sections 1.6 and
3.4); "auto" on a key the model does not determine means that default.

aio.thread_count: DeepSpeed renamed it intra_op_parallelism (PR #7056) and its current parser
silently ignores the old name; tiered honours both spellings (one setting, error if both).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, cast

import torch

from tiered.config.auto import resolve_from_model
from tiered.config.keys import check_section
from tiered.config.schema import (
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
    as_float,
    as_section,
    as_str,
    is_auto,
)
from tiered.errors import ConfigError, UnsupportedConfigError

log = logging.getLogger(__name__)

ZP = "zero_optimization"
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


def pick(section: dict[str, Any], prefix: str, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """The one present spelling among aliases `names`, or None; two spellings is an error."""
    present = [n for n in names if n in section]
    if len(present) > 1:
        spelled = " and ".join(f"{prefix}.{n}" for n in present)
        raise ConfigError(f"{spelled} are aliases of one setting; keep only one")
    return (present[0], section[present[0]]) if present else None


def _count(
    section: dict[str, Any],
    prefix: str,
    names: tuple[str, ...],
    default: int,
    model: torch.nn.Module | None = None,
    minimum: int = 0,
) -> int:
    found = pick(section, prefix, names)
    if found is None:
        return default
    key, value = found
    path = f"{prefix}.{key}"
    if is_auto(value):
        if path in _MODEL_AUTO:
            return resolve_from_model(path, model)
        return default
    return as_count(value, path, minimum=minimum)


_MODEL_AUTO = {
    f"{ZP}.reduce_bucket_size",
    f"{ZP}.stage3_prefetch_bucket_size",
    f"{ZP}.prefetch_bucket_size",
    f"{ZP}.stage3_param_persistence_threshold",
    f"{ZP}.param_persistence_threshold",
}


def _flag(section: dict[str, Any], prefix: str, key: str, default: bool) -> bool:
    if key not in section or section[key] is None or is_auto(section[key]):
        return default
    return as_bool(section[key], f"{prefix}.{key}")


def check_nvme_path(value: Any, path: str) -> str:
    """Validate an nvme_path: created if missing (as DeepSpeed's swapper makedirs its folder),
    and it must then be a writable directory. Errors name the key and the path."""
    text = as_str(value, path)
    target = os.path.expanduser(text)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"{path} = {text!r} is not a directory; point it at a directory on an NVMe drive")
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{path} = {text!r}: cannot create the directory ({exc.strerror or exc}); "
            "point it at a directory on a local NVMe drive that you can write"
        ) from None
    if not os.access(target, os.W_OK | os.X_OK):
        if os.statvfs(target).f_flag & os.ST_RDONLY:  # not a mode: no chmod would help
            raise ConfigError(
                f"{path} = {text!r} is on a read-only filesystem; remount it read-write or point it "
                "at a directory on a writable drive"
            )
        raise ConfigError(
            f"{path} = {text!r} is not writable by this user; fix its permissions or choose another"
        )
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
    return ParamOffloadConfig(
        device=device,
        nvme_path=nvme_path,
        pin_memory=_flag(section, prefix, "pin_memory", pin_default),
        buffer_count=_count(section, prefix, ("buffer_count",), 5, minimum=1),
        buffer_size_numel=_count(section, prefix, ("buffer_size",), 100_000_000, minimum=1),
        max_in_cpu_numel=_count(section, prefix, ("max_in_cpu",), 1_000_000_000),
    )


def parse_offload_optimizer(raw: Any, prefix: str, pin_default: bool) -> OptimizerOffloadConfig:
    section, device, nvme_path = _offload_common(raw, prefix)
    ratio = 1.0
    if section.get("ratio") is not None and not is_auto(section["ratio"]):
        ratio = as_float(section["ratio"], f"{prefix}.ratio", minimum=0.0, maximum=1.0, min_exclusive=True)
    return OptimizerOffloadConfig(
        device=device,
        nvme_path=nvme_path,
        pin_memory=_flag(section, prefix, "pin_memory", pin_default),
        buffer_count=_count(section, prefix, ("buffer_count",), 4, minimum=1),
        ratio=ratio,
        pipeline_read=_flag(section, prefix, "pipeline_read", False),
        pipeline_write=_flag(section, prefix, "pipeline_write", False),
        fast_init=_flag(section, prefix, "fast_init", False),
    )


def parse_zero(raw: Any, model: torch.nn.Module | None) -> ZeroConfig:
    section = as_section(raw if raw is not None else {}, ZP)
    check_section(section, ZP)
    stage = 0
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
    prefetch = _count(section, ZP, ("stage3_prefetch_bucket_size", "prefetch_bucket_size"), 50_000_000, model)
    max_live = _count(section, ZP, ("stage3_max_live_parameters", "max_live_parameters"), 1_000_000_000)
    if max_live == 0:
        log.info(
            "%s.stage3_max_live_parameters 0: as in DeepSpeed, no prefetch and no cap on a module's fetch", ZP
        )
        prefetch, max_live = 0, sys.maxsize
    gather = pick(
        section,
        ZP,
        (
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    )
    return ZeroConfig(
        stage=stage,
        offload_param=offload_param,
        offload_optimizer=offload_opt,
        prefetch_bucket_size_numel=prefetch,
        param_persistence_threshold_numel=_count(
            section, ZP, ("stage3_param_persistence_threshold", "param_persistence_threshold"), 100_000, model
        ),
        model_persistence_threshold_numel=_count(
            section,
            ZP,
            ("stage3_model_persistence_threshold", "model_persistence_threshold"),
            ZeroConfig.model_persistence_threshold_numel,
        ),
        max_live_parameters_numel=max_live,
        max_reuse_distance_numel=_count(
            section, ZP, ("stage3_max_reuse_distance", "max_reuse_distance"), 1_000_000_000
        ),
        gather_16bit_weights_on_model_save=(
            False if gather is None or is_auto(gather[1]) else as_bool(gather[1], f"{ZP}.{gather[0]}")
        ),
        sub_group_size_numel=max(1, _count(section, ZP, ("sub_group_size",), 1_000_000_000)),
        reduce_bucket_size_numel=_count(section, ZP, ("reduce_bucket_size",), 500_000_000, model),
        # DeepSpeed: overlap_comm None -> True for stage 3 only (overlap_comm_valid).
        overlap_comm=_flag(section, ZP, "overlap_comm", stage == 3),
        contiguous_gradients=_flag(section, ZP, "contiguous_gradients", True),
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
    use_gds = _flag(section, "aio", "use_gds", False)
    if use_gds and not torch.cuda.is_available():
        raise UnsupportedConfigError(
            "aio.use_gds is true but CUDA is not available here; GPUDirect Storage needs a CUDA GPU "
            'and cuFile. Set "use_gds": false'
        )
    return AioConfig(
        block_size_bytes=_count(section, "aio", ("block_size",), 1_048_576, minimum=1),
        queue_depth=_count(section, "aio", ("queue_depth",), 8, minimum=1),
        thread_count=_count(section, "aio", ("thread_count", "intra_op_parallelism"), 1, minimum=1),
        single_submit=_flag(section, "aio", "single_submit", False),
        overlap_events=_flag(section, "aio", "overlap_events", True),
        use_gds=use_gds,
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
    adam_w_mode = True if adam_w_mode is None else as_bool(adam_w_mode, f"{p}.adam_w_mode")
    if type_ == "AdamW" and not adam_w_mode:
        raise ConfigError(
            f'{p}.adam_w_mode is false but optimizer.type is "AdamW" (DeepSpeed would silently run AdamW); '
            'use "type": "Adam" with adam_w_mode false for L2 weight decay'
        )
    lr, betas, eps, wd = value("lr"), value("betas"), value("eps"), value("weight_decay")
    return OptimizerConfig(
        type=type_,
        lr=defaults.lr if lr is None else as_float(lr, f"{p}.lr", minimum=0.0),
        betas=defaults.betas if betas is None else as_betas(betas, f"{p}.betas"),
        eps=defaults.eps if eps is None else as_float(eps, f"{p}.eps", minimum=0.0),
        weight_decay=defaults.weight_decay if wd is None else as_float(wd, f"{p}.weight_decay", minimum=0.0),
        # DeepSpeed: effective adam_w_mode = (type == AdamW) or adam_w_mode (default True).
        adamw_mode=adam_w_mode,
    )


def parse_precision(config: dict[str, Any]) -> PrecisionConfig:
    bf16_found = pick(config, "", ("bf16", "bfloat16"))
    bf16_on = False
    if bf16_found is not None:
        key, raw = bf16_found
        section = as_section(raw, key)
        check_section(section, "bf16")
        bf16_on = _flag(section, key, "enabled", False)
    fp16 = as_section(config.get("fp16") or {}, "fp16")
    check_section(fp16, "fp16")
    fp16_on = _flag(fp16, "fp16", "enabled", False)
    if bf16_on and fp16_on:
        raise ConfigError("bf16.enabled and fp16.enabled are both true; enable only one of them")
    d = PrecisionConfig()

    def num(key: str, default: float, **bounds: Any) -> float:
        v = fp16.get(key)
        return default if v is None or is_auto(v) else as_float(v, f"fp16.{key}", **bounds)

    return PrecisionConfig(
        dtype=torch.bfloat16 if bf16_on else torch.float16 if fp16_on else torch.float32,
        loss_scale=num("loss_scale", d.loss_scale, minimum=0.0),
        initial_scale_power=_count(fp16, "fp16", ("initial_scale_power",), d.initial_scale_power),
        loss_scale_window=_count(fp16, "fp16", ("loss_scale_window",), d.loss_scale_window, minimum=1),
        hysteresis=_count(fp16, "fp16", ("hysteresis",), d.hysteresis, minimum=1),
        min_loss_scale=num("min_loss_scale", d.min_loss_scale, minimum=0.0, min_exclusive=True),
        consecutive_hysteresis=_flag(fp16, "fp16", "consecutive_hysteresis", False),
        auto_cast=_flag(fp16, "fp16", "auto_cast", False),
    )
