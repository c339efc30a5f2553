"""[Note: a raw config by field]: which declared keys a raw config writes, and a raw config with
fields set at their declared spelling, read back by `load_config` to the values set."""

from __future__ import annotations

import torch

from tiered.config.fields import (
    PRECISION_FIELD,
    TIERS_FIELD,
    declared_key,
    value_of,
    with_fields,
    with_tier_budgets,
    written_fields,
)
from tiered.config.loader import load_config
from tiered.config.schema import TieredConfig
from tiered.planning.candidate import KNOB_FIELDS


def test_written_fields_follow_every_spelling_and_skip_null_and_auto() -> None:
    raw = {
        "zero_optimization": {
            "sub_group_size": 1e8,
            "param_persistence_threshold": 0,  # DeepSpeed's alias
            "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": None,
            "cpu_offload": True,  # DeepSpeed's older flag: offload_optimizer.device "cpu"
        },
        "bf16": {"enabled": True},
        "tiered": {"tiers": {"cpu": {"budget": "1GiB"}}},
    }
    assert written_fields(raw) == {
        "zero.sub_group_size_numel",
        "zero.param_persistence_threshold_numel",
        "zero.offload_optimizer.device",
        PRECISION_FIELD,
        TIERS_FIELD,
    }
    assert written_fields({}) == frozenset()


def test_with_fields_writes_the_declared_spelling_and_load_config_reads_it_back() -> None:
    raw = {"zero_optimization": {"param_persistence_threshold": "auto", "stage": 3}}
    values = {
        "zero.param_persistence_threshold_numel": 7,
        "zero.offload_optimizer.device": "cpu",
        "zero.offload_optimizer.buffer_count": 2,
        "tiered.grad_tier": "cpu",
        PRECISION_FIELD: torch.bfloat16,
    }
    out = with_fields(raw, values)
    zero = out["zero_optimization"]
    assert "param_persistence_threshold" not in zero  # the alias is gone: one spelling of one setting
    assert zero["stage3_param_persistence_threshold"] == 7 and zero["stage"] == 3
    assert raw == {"zero_optimization": {"param_persistence_threshold": "auto", "stage": 3}}  # a copy
    cfg = load_config(with_tier_budgets(out, {"cpu": 2**30}))
    for attr, value in values.items():
        assert value_of(cfg, attr) == value, attr
    assert cfg.tiered.tiers["cpu"].budget_bytes == 2**30 and cfg.tiered.tiers["cpu"].backend == {
        "type": "cpu"
    }
    # what was not set is the declaration's default
    assert cfg.zero.sub_group_size_numel == TieredConfig().zero.sub_group_size_numel
    fp32 = load_config(with_fields(out, {PRECISION_FIELD: torch.float32}))
    assert fp32.precision.dtype == torch.float32


def test_every_knob_of_the_search_is_a_declared_field() -> None:
    for knob, attr in KNOB_FIELDS.items():
        assert declared_key(attr).path, knob
        value_of(TieredConfig(), attr)
