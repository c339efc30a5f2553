"""The `scheduler` section: DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR params.

`normalize_scheduler` fills every param with DeepSpeed's code default
(deepspeed/runtime/lr_schedules.py), resolves "auto", and checks types, so the resolved
`SchedulerConfig.params` is complete and round-trips through JSON. It is idempotent: the
scheduler builder calls it again on hand-made configs.

"auto" resolution (as Hugging Face's Trainer fills them; [Note: caller-supplied hyper-parameters]):
- warmup_min_lr "auto" -> 0.0 (HF's constant); warmup_max_lr "auto" -> the optimizer's lr (stays
  "auto" while that lr is unset);
- warmup_num_steps "auto" and total_num_steps "auto" stay "auto" (unset) until the caller
  supplies them (`tiered.initialize(..., warmup_steps=, total_steps=)`, which fills the raw
  config first; `build_scheduler(..., total_steps=N)` for total_num_steps). A missing
  warmup_num_steps is DeepSpeed's default, 1000: the file's meaning in DeepSpeed.
A missing warmup_max_lr for WarmupLR means the optimizer's lr, as in DeepSpeed's current code;
for WarmupDecayLR it is 0.001, DeepSpeed's default there. WarmupLR and WarmupDecayLR then drive
the lr to warmup_max_lr regardless of optimizer.params.lr, exactly as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

from tiered.config.keys import is_comment, unknown_key_error
from tiered.config.values import AUTO, as_choice, as_count, as_float, as_section, is_auto
from tiered.errors import ConfigError, UnsupportedConfigError

SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_DS_UNSUPPORTED = ("OneCycle", "LRRangeTest")
WARMUP_TYPES = ("log", "linear")

_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": (
        "total_num_steps",
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    ),
    "WarmupCosineLR": (
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    ),
}


def scheduler_type(value: Any, path: str = "scheduler.type") -> str:
    """Canonical scheduler type name; UnsupportedConfigError for DeepSpeed's other schedulers."""
    if isinstance(value, str):
        for name in SCHEDULER_TYPES:
            if value.strip().lower() == name.lower():
                return name
        for name in _DS_UNSUPPORTED:
            if value.strip().lower() == name.lower():
                raise UnsupportedConfigError(
                    f"{path} = {value!r} is a DeepSpeed scheduler tiered does not support; "
                    f"use one of {', '.join(SCHEDULER_TYPES)}, or drive the lr yourself"
                )
    raise ConfigError(f"{path}: unknown scheduler {value!r}; use one of {', '.join(SCHEDULER_TYPES)}")


def normalize_scheduler(
    type_: str, params: Any, *, base_lr: float | None, path: str = "scheduler"
) -> dict[str, Any]:
    """Complete, validated params for scheduler `type_` (see module docstring)."""
    type_ = scheduler_type(type_, f"{path}.type")
    params = as_section(params if params is not None else {}, f"{path}.params")
    where = f"{path}.params"
    allowed = _PARAMS[type_]
    params = {k: v for k, v in params.items() if not is_comment(k)}
    for key in params:
        if key not in allowed:
            raise unknown_key_error(where, key, allowed)

    def get(key: str, default: Any) -> Any:
        value = params.get(key, default)
        return default if value is None else value

    out: dict[str, Any] = {}
    if "total_num_steps" in allowed:
        if "total_num_steps" not in params:
            raise ConfigError(
                f"{where}.total_num_steps is required for {type_}; set the number of optimizer steps, "
                f'or "auto" and pass total_steps= to tiered.initialize'
            )
        total = params["total_num_steps"]
        out["total_num_steps"] = (
            AUTO if is_auto(total) else as_count(total, f"{where}.total_num_steps", minimum=1)
        )
    if type_ in ("WarmupLR", "WarmupDecayLR"):
        min_lr = get("warmup_min_lr", 0.0)
        out["warmup_min_lr"] = (
            0.0 if is_auto(min_lr) else as_float(min_lr, f"{where}.warmup_min_lr", minimum=0.0)
        )
        max_default: Any = (AUTO if base_lr is None else base_lr) if type_ == "WarmupLR" else 0.001
        max_lr = get("warmup_max_lr", max_default)
        if is_auto(max_lr):
            out["warmup_max_lr"] = AUTO if base_lr is None else base_lr  # AUTO: the lr is unset
        else:
            out["warmup_max_lr"] = as_float(max_lr, f"{where}.warmup_max_lr", minimum=0.0)
    else:
        min_ratio = get("warmup_min_ratio", 0.0)
        out["warmup_min_ratio"] = (
            0.0
            if is_auto(min_ratio)
            else as_float(min_ratio, f"{where}.warmup_min_ratio", minimum=0.0, maximum=1.0)
        )
        cos_min = get("cos_min_ratio", 0.0001)
        out["cos_min_ratio"] = (
            0.0001
            if is_auto(cos_min)
            else as_float(cos_min, f"{where}.cos_min_ratio", minimum=0.0, maximum=1.0)
        )
    steps = get("warmup_num_steps", 1000)
    # DeepSpeed raises for warmup_num_steps <= 0 and then uses max(2, n); keep both rules.
    out["warmup_num_steps"] = (
        AUTO if is_auto(steps) else as_count(steps, f"{where}.warmup_num_steps", minimum=1)
    )
    out["warmup_type"] = as_choice(get("warmup_type", "log"), f"{where}.warmup_type", WARMUP_TYPES)
    last = get("last_batch_iteration", -1)
    if as_count(last, f"{where}.last_batch_iteration", minimum=-1) != -1:
        raise UnsupportedConfigError(
            f"{where}.last_batch_iteration = {last!r}: starting a schedule mid-way is not supported in the "
            "config; tiered resumes the schedule from its checkpoint's step count. Remove the key"
        )
    out["last_batch_iteration"] = -1
    return out
