"""Gradients homed on NVMe (``tiered.grad_tier: "nvme"``, [Note: gradients on nvme]): training
equals plain PyTorch AdamW to 1e-5, with and without clipping and accumulation."""

from __future__ import annotations

import pytest
from engine_support import (
    CASES,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    make_batches,
    reference_train,
    tiered_train,
)

import tiered


@pytest.mark.parametrize(
    ("name", "gas", "clip"), [("mlp", 1, 0.0), ("mlp", 1, 0.05), ("mlp", 3, 0.05), ("llama", 2, 0.05)]
)
def test_nvme_gradients_equal_plain_adamw(tmp_path, name, gas, clip):
    case = CASES[name]
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), gas=gas, clip=clip)
    cfg["tiered"] = {"grad_tier": "nvme"}
    batches = make_batches(case, steps=3, micro=4, gas=gas)
    ref_losses, ref_state = reference_train(build(case), case, batches, lr=1e-3, clip=clip, gas=gas)
    losses, state, stats = tiered_train(build(case), case, batches, cfg)
    assert_losses_close(losses, ref_losses)
    assert_params_close(state, ref_state, rel=1e-5)
    assert stats["tiers"]["links"]["nvme->cpu"]["bytes"] > 0


def test_gradient_partitions_live_on_nvme(tmp_path):
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"))
    cfg["tiered"] = {"grad_tier": "nvme"}
    with tiered.initialize(build(CASES["mlp"]), cfg) as engine:
        homes = {g.grad.home for g in engine.zero.groups if g.grad is not None}
        assert homes == {"nvme"}
        assert engine.zero.tm.resident_bytes("cpu") == 0  # no gradient bytes held in host memory


def test_grad_tier_needs_an_offloaded_optimizer(tmp_path):
    cfg = ds_config(param="nvme", nvme_path=str(tmp_path / "nvme"))
    cfg["tiered"] = {"grad_tier": "nvme"}
    with pytest.raises(tiered.ConfigError, match="tiered.grad_tier"):
        tiered.initialize(build(CASES["mlp"]), cfg)


def test_plan_40b_on_64gb_host_recommends_nvme_gradients(capsys):
    """`tiered plan --params 40e9 --gpu-mem 80GB --cpu-mem 64GB --nvme-mem 4TB` fits only with the
    gradients on NVMe, and its printed config is one the engine accepts (tiered.grad_tier)."""
    import json

    from tiered.cli.main import main
    from tiered.config.loader import load_config

    args = [
        "plan",
        "--params",
        "40e9",
        "--gpu-mem",
        "80GB",
        "--cpu-mem",
        "64GB",
        "--nvme-mem",
        "4TB",
        "--json",
    ]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"] == "zero3_all_nvme"
    rows = {s["key"]: s for s in doc["strategies"]}
    assert not rows["zero3_opt_param_nvme"]["fits_all"]  # gradients in host memory: 171.6 GB of CPU
    assert rows["zero3_all_nvme"]["bytes"]["cpu"] <= 64e9
    assert rows["zero3_all_nvme"]["grad_tier"] == "nvme"
    io = {k: rows[k]["nvme_io_bytes_per_step"] for k in ("zero3_all_nvme", "zero3_opt_param_nvme")}
    assert io["zero3_all_nvme"] - io["zero3_opt_param_nvme"] == 12 * 40_000_000_000
    cfg = doc["config"]
    assert cfg["tiered"]["grad_tier"] == "nvme"
    assert load_config(cfg).tiered.grad_tier == "nvme"
