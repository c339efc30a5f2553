"""The config written for one set of searched knobs ([Note: config search] in search.py): the
knobs laid onto the search's `Base` through tiered.config's fields ([Note: a raw config by
field]), so every key is spelled by its declaration and every key left out is the
declaration's default; and the knobs sized from the others (`overlap_applies`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiered.config.fields import PRECISION_FIELD, value_of, with_fields, with_tier_budgets, written_fields
from tiered.config.loader import load_config
from tiered.config.schema import TieredConfig
from tiered.errors import ConfigError

KNOB_FIELDS: dict[str, str] = {
    "offload_optimizer": "zero.offload_optimizer.device",
    "offload_param": "zero.offload_param.device",
    "grad_tier": "tiered.grad_tier",
    "sub_group_size": "zero.sub_group_size_numel",
    "buffer_count": "zero.offload_optimizer.buffer_count",
    "persistence_threshold": "zero.param_persistence_threshold_numel",
    "max_in_cpu": "zero.offload_param.max_in_cpu_numel",
    "max_live_parameters": "zero.max_live_parameters_numel",
    "overlap_step": "zero.overlap_step_with_backward",
    "prefetch_bucket_size": "zero.prefetch_bucket_size_numel",
    "ratio": "zero.offload_optimizer.ratio",
}
"""Each knob a user may pin (`search.Pinned`, by the names the plan's flags and errors use) and
the `TieredConfig` field it sets."""
_REUSE_DISTANCE = "zero.max_reuse_distance_numel"
_NVME_PATHS = {
    "offload_optimizer": "zero.offload_optimizer.nvme_path",
    "offload_param": "zero.offload_param.nvme_path",
}
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Base:
    """The config every candidate is laid onto, read once by `load_config`: the user's own
    (``auto_config``: its keys validated before anything reads them), or `plan_base`'s. `cfg`
    is its resolved form (precision, accumulation, clipping, pinned values), `written` the
    fields it sets itself, which a candidate never changes."""

    raw: Mapping[str, Any]
    cfg: TieredConfig
    written: frozenset[str]

    @staticmethod
    def read(raw: Mapping[str, Any], model: nn.Module | None = None, *, world_size: int = 1) -> Base:
        """`raw` validated (ConfigError naming the key) and resolved."""
        cfg = load_config(dict(raw), model=model, world_size=world_size)
        return Base(raw, cfg, written_fields(raw))

    def pins(self) -> dict[str, Any]:
        """The knobs this config sets itself, at their resolved values ([Note: auto config])."""
        return {knob: value_of(self.cfg, f) for knob, f in KNOB_FIELDS.items() if f in self.written}

    @property
    def nvme_path(self) -> str | None:
        """The nvme_path the config names (the optimizer's first), None when it names none."""
        z = self.cfg.zero
        return z.offload_optimizer.nvme_path or z.offload_param.nvme_path

    def default(self, knob: str) -> Any:
        """The value of `knob`'s field in this config (the declaration's default unless written)."""
        return value_of(self.cfg, KNOB_FIELDS[knob])


def plan_base(precision: str = "bf16", accumulation: int = 1) -> Base:
    """The base of a plan made without a config of the user's (`tiered plan`): only the
    precision and the accumulation steps are set."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision: unknown precision {precision!r}; use bf16, fp16 or fp32")
    fields = {PRECISION_FIELD: PRECISIONS[precision], "gradient_accumulation_steps": accumulation}
    return Base.read(with_fields({}, fields))


def candidate_config(
    knobs: Mapping[str, Any], base: Base, *, nvme_path: str | None, budgets: Mapping[str, int | str | None]
) -> dict[str, Any]:
    """`base` with the knobs' fields set (those the base writes itself kept) and tier budgets."""
    opt, par, grad = knobs["offload_optimizer"], knobs["offload_param"], knobs["grad_tier"]
    on_nvme = "nvme" in (opt, par, grad)
    if on_nvme and nvme_path is None:
        raise ConfigError("an NVMe placement needs an nvme_path; none was given")
    values: dict[str, Any] = {
        "zero.stage": 3,
        KNOB_FIELDS["offload_optimizer"]: opt,
        KNOB_FIELDS["offload_param"]: par,
        KNOB_FIELDS["sub_group_size"]: knobs["sub_group_size"],
        KNOB_FIELDS["persistence_threshold"]: knobs["persistence_threshold"],
    }
    if grad == "nvme":  # "cpu" and "gpu" are where gradients go by default ([Note: gradients on nvme])
        values[KNOB_FIELDS["grad_tier"]] = grad
    if opt != "none":
        values[KNOB_FIELDS["buffer_count"]] = knobs["buffer_count"]
    for section, device in (("offload_optimizer", opt), ("offload_param", par)):
        if device == "nvme":
            values[_NVME_PATHS[section]] = nvme_path
    if par == "nvme" and knobs.get("max_in_cpu") is not None:
        values[KNOB_FIELDS["max_in_cpu"]] = knobs["max_in_cpu"]
    if knobs.get("max_live_parameters"):  # [Note: the live budget searched]
        values[KNOB_FIELDS["max_live_parameters"]] = knobs["max_live_parameters"]
        values[_REUSE_DISTANCE] = 2 * knobs["max_live_parameters"]
    if knobs.get("prefetch_bucket_size") is not None:
        values[KNOB_FIELDS["prefetch_bucket_size"]] = knobs["prefetch_bucket_size"]
    if knobs.get("overlap_step"):  # false is the declared default
        values[KNOB_FIELDS["overlap_step"]] = True
    if (
        opt != "none" and knobs.get("ratio") is not None and knobs["ratio"] < 1
    ):  # [Note: the GPU's room searched]
        values[KNOB_FIELDS["ratio"]] = knobs["ratio"]
    if knobs.get("residency") not in (None, "auto"):  # [Note: the live budget searched]
        values["tiered.residency"] = knobs["residency"]
    if KNOB_FIELDS["max_live_parameters"] in base.written:  # the reuse distance goes with the user's own
        values.pop(_REUSE_DISTANCE, None)
    raw = with_fields(base.raw, {f: v for f, v in values.items() if f not in base.written})
    tiers = {t: b for t, b in budgets.items() if b is not None and (t != "nvme" or on_nvme)}
    return with_tier_budgets(raw, tiers)


def overlap_applies(knobs: Mapping[str, Any], base: Base) -> bool:
    """``tiered.overlap_step_with_backward`` for this candidate ([Note: config search]): where
    gradients are homed on disk and nothing needs the whole gradient first (`overlap_blockers`:
    no clipping, not fp16; and accumulation 1, `grads_consumed_from_memory`), the step takes
    each gradient from memory and the disk round trip goes. Exact, so chosen freely; a value
    the user wrote (pinned, or in the base config) is kept, and a clipping or accumulation the
    base leaves to the caller ("auto") may block it, so it is not chosen."""
    if knobs.get("overlap_step") is not None:
        return bool(knobs["overlap_step"])
    cfg = base.cfg
    if KNOB_FIELDS["overlap_step"] in base.written:
        return cfg.zero.overlap_step_with_backward
    if {"gradient_clipping", "gradient_accumulation_steps"} & set(cfg.unset) or cfg.gradient_clipping > 0:
        return False
    return (
        knobs["grad_tier"] == "nvme"
        and cfg.precision.dtype != torch.float16
        and cfg.gradient_accumulation_steps == 1
    )
