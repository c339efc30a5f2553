"""[Note: auto config]: ``tiered.auto_config`` resolved by `tiered.initialize` over the model being
trained: the chosen config fits what was given, every knob the config set itself is kept, and
nothing fitting is a CapacityError naming the closest config and each shortfall."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

import tiered
from tiered.errors import CapacityError, ConfigError

transformers = pytest.importorskip("transformers")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(small_llama_config())


def _config(tmp_path: Path, **auto: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "tiered": {"auto_config": auto},
    }


def test_auto_config_chooses_a_fitting_config_and_keeps_pinned_knobs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _config(tmp_path, cpu_mem="2GiB", gpu_mem="64MiB", nvme_mem="1GiB")
    with caplog.at_level(logging.INFO, logger="tiered.planning.auto"):
        engine = tiered.initialize(_model(), cfg)
    with engine:
        c = engine.config
        assert c.zero.offload_optimizer.device == "nvme"  # pinned by the config itself
        assert c.tiered.tiers["cpu"].budget_bytes is not None
        assert c.tiered.tiers["cpu"].budget_bytes <= 2 * 2**30  # never above what was given
        assert c.tiered.tiers["gpu"].budget_bytes is not None
        assert c.tiered.tiers["gpu"].budget_bytes <= 64 * 2**20
        x = torch.randint(0, 512, (1, 8))
        out = engine(input_ids=x, labels=x)
        engine.backward(out.loss)
        engine.step()
    assert "tiered.auto_config chose" in caplog.text


def test_auto_config_nothing_fits_names_the_closest_and_each_shortfall(tmp_path: Path) -> None:
    cfg = _config(tmp_path, cpu_mem="1MiB", gpu_mem="1MiB", nvme_mem="1MiB")
    with pytest.raises(CapacityError, match="nothing fits") as err:
        tiered.initialize(_model(), cfg)
    assert "closest" in str(err.value) and "short by" in str(err.value)


def test_auto_config_with_own_tiers_or_unknown_key_is_refused(tmp_path: Path) -> None:
    cfg = _config(tmp_path, cpu_mem="2GiB")
    cfg["tiered"]["tiers"] = {"cpu": {"budget": "1GiB"}}
    with pytest.raises(ConfigError, match="tiered.tiers is set too"):
        tiered.initialize(_model(), cfg)
    with pytest.raises(
        ConfigError, match="unknown configuration key 'tiered.auto_config.cpu_memory'; did you"
    ):
        tiered.initialize(_model(), _config(tmp_path, cpu_memory="2GiB"))


def test_load_config_refuses_an_unresolved_auto_config(tmp_path: Path) -> None:
    from tiered.config.loader import load_config

    with pytest.raises(ConfigError, match="tiered.auto_config is resolved where the model is known"):
        load_config(_config(tmp_path, cpu_mem="2GiB"))


def test_preflight_lists_every_short_tier_at_once_and_a_config_that_fits(tmp_path: Path) -> None:
    """issue 21: a 1 GiB-class refusal named the tiers one run at a time; now every tier short is in
    one error, each with the keys that fix it, and the planner's config for the same budgets."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 200_000,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4},
            "offload_param": {"device": "cpu"},
        },
        "tiered": {"tiers": {"cpu": {"budget": "600KiB"}, "nvme": {"budget": "600KiB"}}},
    }
    with pytest.raises(CapacityError) as err:
        tiered.initialize(_model(), cfg)
    text = str(err.value)
    assert "cpu budget" in text and "nvme budget" in text  # both, in one error
    assert "offload_optimizer.buffer_count" in text  # the key that fixes the cpu tier
    assert "A config that fits these budgets" in text or "No config fits these budgets" in text


# ---- issue 37: the user's keys are validated before the planner reads them -------------------------
@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 3, "sub_group_size": "abc"},
        {"stage": 3, "sub_group_size": float("nan")},
        {"stage": 3, "offload_optimizer": {"device": "cpu", "buffer_count": "x"}},
        {"stage": 3, "offload_optimizer": "cpu"},
        {"stage": 3, "stage3_param_persistence_threshold": [1]},
        [],
    ],
)
def test_a_bad_pinned_key_is_the_same_config_error_as_without_auto_config(tmp_path: Path, zero: Any) -> None:
    """A bad value of a key the search pins was a raw ValueError/AttributeError/TypeError from the
    planner; now the config is validated first: the ConfigError naming the key, word for word the
    one the same config gets without auto_config."""
    cfg = _config(tmp_path, cpu_mem="2GiB")
    cfg["zero_optimization"] = zero
    plain = {k: v for k, v in cfg.items() if k != "tiered"}
    with pytest.raises(ConfigError) as without:
        tiered.initialize(_model(), plain)
    with pytest.raises(ConfigError) as with_auto:
        tiered.initialize(_model(), cfg)
    assert str(with_auto.value) == str(without.value)
    assert "zero_optimization" in str(with_auto.value)


def test_memory_beyond_the_machine_names_the_auto_config_key(tmp_path: Path) -> None:
    """cpu_mem above this machine's memory was refused by the engine naming tiered.tiers.cpu.budget,
    a key the user never wrote; now by the key the user gave."""
    for key in ("cpu_mem", "gpu_mem", "nvme_mem"):
        with pytest.raises(CapacityError) as err:
            tiered.initialize(_model(), _config(tmp_path, **{key: "1PB"}))
        text = str(err.value)
        assert f"tiered.auto_config.{key} " in text and "has in all" in text, text
        assert "tiered.tiers" not in text


def test_nothing_fits_names_the_memories_as_given_and_the_missing_nvme_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an nvme_path in the config no NVMe placement is weighed (none was invented, nothing
    is created in the working folder), and the refusal says so, naming the memory as given."""
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path, cpu_mem="1MiB")
    cfg["zero_optimization"] = {"stage": 3}
    with pytest.raises(CapacityError) as err:
        tiered.initialize(_model(), cfg)
    text = str(err.value)
    assert "nothing fits the memory given (tiered.auto_config.cpu_mem 1.00 MiB)" in text
    assert "NVMe placements were not weighed" in text and "nvme_path" in text
    assert list(tmp_path.iterdir()) == []


def test_a_pinned_key_spelled_by_its_alias_is_kept_as_written(tmp_path: Path) -> None:
    """DeepSpeed's alias ``param_persistence_threshold``: the planner wrote the canonical spelling
    beside it, and the config was refused for naming one setting twice."""
    cfg = _config(tmp_path, cpu_mem="4GiB")
    cfg["zero_optimization"]["param_persistence_threshold"] = 0
    with tiered.initialize(_model(), cfg) as engine:
        assert engine.config.zero.param_persistence_threshold_numel == 0


def test_a_clipping_left_to_the_caller_is_read_from_the_resolved_config(tmp_path: Path) -> None:
    """gradient_clipping "auto" (Hugging Face's) was read as float("auto") by the planner; now it
    is unset in the resolved config, the caller's keyword supplies it, and the overlapped step
    (which clipping blocks) is not chosen for it."""
    cfg = _config(tmp_path, cpu_mem="4GiB")
    cfg["gradient_clipping"] = "auto"
    cfg["tiered"]["grad_tier"] = "nvme"
    with tiered.initialize(_model(), cfg, max_grad_norm=1.0) as engine:
        assert engine.config.gradient_clipping == 1.0
        assert engine.config.zero.overlap_step_with_backward is False
