"""A declared tier is used or the config is refused; the printout names the tiers really used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import tiered
from tiered.config import load_config
from tiered.engine.build import choose_placement
from tiered.errors import ConfigError


def _cfg(tmp_path: Path, **tiered_keys: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "tiered": {
            "tiers": {
                "stripe": {"backend": {"type": "stripe", "paths": [str(tmp_path / "a"), str(tmp_path / "b")]}}
            },
            **tiered_keys,
        },
    }


def test_declared_tier_with_nothing_routed_is_refused(tmp_path: Path) -> None:
    cfg = load_config(_cfg(tmp_path))
    with pytest.raises(
        ConfigError, match=r"tiered\.tiers\.stripe.*nothing is routed.*param_tier.*optimizer_tier"
    ):
        choose_placement(cfg)


def test_initialize_refuses_it_before_opening_anything(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"tiered\.tiers\.stripe is declared but nothing is routed"):
        tiered.initialize(model, _cfg(tmp_path))
    assert not (tmp_path / "a").exists(), "the unused tier's backend was opened anyway"


def test_routed_tier_is_accepted_and_named_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(_cfg(tmp_path, optimizer_tier="stripe"))
    with caplog.at_level(logging.INFO, logger="tiered.engine.build"):
        placement = choose_placement(cfg)
    assert placement.optimizer_tier == "stripe"
    assert "optimizer state in stripe" in placement.describe(cfg)
    assert "tiers used: params in gpu, gradients in cpu, optimizer state in stripe" in caplog.text


def test_describe_names_the_backend_type_behind_a_custom_tier(tmp_path: Path) -> None:
    raw = _cfg(tmp_path, optimizer_tier="remote")
    raw["tiered"]["tiers"] = {"remote": {"backend": {"type": "cpu"}}}
    cfg = load_config(raw)
    assert choose_placement(cfg).describe(cfg) == (
        "params in gpu, gradients in cpu, optimizer state in remote (cpu)"
    )


def test_derived_tiers_never_count_as_unused(tmp_path: Path) -> None:
    raw = _cfg(tmp_path)
    raw["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "nv")}
    raw["tiered"] = {}
    cfg = load_config(raw)
    placement = choose_placement(cfg)
    assert (placement.param_tier, placement.optimizer_tier) == ("nvme", "cpu")
    assert torch.float32 == placement.compute_dtype
