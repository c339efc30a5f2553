"""The config written for one set of searched knobs ([Note: config search] in search.py): a
DeepSpeed-format config with a "tiered" section, alone or laid onto a user's own config
([Note: auto config]), and the knobs sized from the others (`overlap_applies`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def candidate_config(
    knobs: Mapping[str, Any],
    *,
    precision: str,
    accumulation: int,
    nvme_path: str,
    budgets: Mapping[str, int | None],
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed-format config (+ "tiered") for one set of knobs; with `base` (a user's
    config, [Note: auto config]) its other keys are kept and the knobs' keys set."""
    if base is not None:
        own = candidate_config(
            knobs, precision=precision, accumulation=accumulation, nvme_path=nvme_path, budgets=budgets
        )
        return _onto(base, own)
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": knobs["sub_group_size"],
        "stage3_param_persistence_threshold": knobs["persistence_threshold"],
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if knobs.get("max_live_parameters"):  # [Note: the live budget searched]
        zero["stage3_max_live_parameters"] = knobs["max_live_parameters"]
        zero["stage3_max_reuse_distance"] = 2 * knobs["max_live_parameters"]
    if knobs["offload_optimizer"] != "none":
        off: dict[str, Any] = {
            "device": knobs["offload_optimizer"],
            "pin_memory": True,
            "buffer_count": knobs["buffer_count"],
        }
        if knobs["offload_optimizer"] == "nvme":
            off["nvme_path"] = nvme_path
        zero["offload_optimizer"] = off
    if knobs["offload_param"] != "none":
        offp: dict[str, Any] = {"device": knobs["offload_param"], "pin_memory": True}
        if knobs["offload_param"] == "nvme":
            offp.update(nvme_path=nvme_path, max_in_cpu=knobs["max_in_cpu"])
        zero["offload_param"] = offp
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
    }
    if precision in ("bf16", "fp16"):
        config[precision] = {"enabled": True}
    config["zero_optimization"] = zero
    tiers = {t: {"budget": b} for t, b in budgets.items() if b is not None}
    if "nvme" in tiers and "nvme" not in (
        knobs["offload_optimizer"],
        knobs["offload_param"],
        knobs["grad_tier"],
    ):
        del tiers["nvme"]
    tiered: dict[str, Any] = {"tiers": tiers}
    if knobs["grad_tier"] not in ("cpu", "gpu"):
        tiered["grad_tier"] = knobs["grad_tier"]  # [Note: gradients on nvme]
    if knobs.get("overlap_step"):
        tiered["overlap_step_with_backward"] = True
    config["tiered"] = tiered
    return config


def _onto(base: Mapping[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """`base` with the chosen zero_optimization and tiered keys set (the rest of base kept)."""
    out = copy.deepcopy(dict(base))
    zero = out.setdefault("zero_optimization", {})
    zero["stage"] = 3
    for key, value in chosen["zero_optimization"].items():
        if isinstance(value, dict):
            zero[key] = {**(zero.get(key) or {}), **value}
        elif key not in zero or key in ("sub_group_size", "stage3_param_persistence_threshold"):
            zero[key] = value
    for key in ("offload_optimizer", "offload_param"):
        if key not in chosen["zero_optimization"] and key in zero:
            del zero[key]  # the chosen placement keeps it on the GPU
    tiered = out.setdefault("tiered", {})
    tiered["tiers"] = chosen["tiered"]["tiers"]
    tiered.pop("grad_tier", None)
    if "grad_tier" in chosen["tiered"]:
        tiered["grad_tier"] = chosen["tiered"]["grad_tier"]
    if "overlap_step_with_backward" in chosen["tiered"]:
        tiered.setdefault("overlap_step_with_backward", chosen["tiered"]["overlap_step_with_backward"])
    for key in ("bf16", "fp16", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if key in chosen and key not in out:
            out[key] = chosen[key]
    return out


def overlap_applies(
    knobs: Mapping[str, Any], precision: str, accumulation: int, base: Mapping[str, Any] | None
) -> bool:
    """``tiered.overlap_step_with_backward`` for this candidate ([Note: config search]): where
    gradients are homed on disk and nothing needs the whole gradient first (`overlap_blockers`:
    no clipping, not fp16; and accumulation 1, `grads_consumed_from_memory`), the step takes
    each gradient from memory and the disk round trip goes. Exact, so chosen freely; a value
    the user wrote (pinned, or in the base config) is kept."""
    if knobs.get("overlap_step") is not None:
        return bool(knobs["overlap_step"])
    if base is not None:
        said = (base.get("tiered") or {}).get("overlap_step_with_backward")
        if said is not None:
            return bool(said)
        if float(base.get("gradient_clipping") or 0) > 0:
            return False
    return knobs["grad_tier"] == "nvme" and precision != "fp16" and accumulation == 1
