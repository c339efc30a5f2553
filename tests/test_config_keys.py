"""Strictness that matches users' files: comments, DeepSpeed's other sections, valid zeros, keys
with no effect, keys in the wrong section, multimodal "auto"."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiered.config import keys as config_keys
from tiered.config import load_config
from tiered.errors import ConfigError, UnsupportedConfigError

sys.path.insert(0, str(Path(__file__).parent))

ZP = "zero_optimization"


@pytest.fixture(autouse=True)
def _fresh_logs() -> None:
    config_keys._logged_ignored.clear()
    config_keys._warned.clear()


def test_underscore_keys_are_comments_at_any_depth() -> None:
    cfg = load_config(
        {
            "_comment": "from LLaMA-Factory",
            "_note": {"any": "thing"},
            ZP: {"_comment": "z3", "stage": 3, "offload_param": {"_why": "ram", "device": "cpu"}},
            "scheduler": {"type": "WarmupLR", "params": {"_c": 1, "warmup_num_steps": 5}},
            "optimizer": {"type": "AdamW", "_c": 0, "params": {"lr": 1e-3, "_c": 0}},
        }
    )
    assert cfg.zero.offload_param.device == "cpu" and cfg.scheduler is not None


def test_comment_like_typo_still_gets_no_comet_hint() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"comment": "x"})
    assert "comet" not in str(info.value) and '"_comment"' in str(info.value)
    load_config({"_comment": "x"})


def test_known_key_in_the_wrong_section_says_where_it_belongs() -> None:
    with pytest.raises(ConfigError, match=r"aio belongs at the top level"):
        load_config({ZP: {"stage": 3, "aio": {"block_size": 1048576}}})
    with pytest.raises(ConfigError, match=r"stage belongs at 'zero_optimization'"):
        load_config({"stage": 3})
    with pytest.raises(ConfigError, match=r"nvme_path belongs at .*offload_optimizer.* or .*offload_param"):
        load_config({ZP: {"stage": 3, "nvme_path": "/tmp"}})
    # an unknown key keeps the nearest valid key
    with pytest.raises(ConfigError, match=r"did you mean 'zero_optimization.stage3_prefetch_bucket_size'"):
        load_config({ZP: {"stage3_prefetch_bucket_sz": 1}})


@pytest.mark.parametrize(
    "key",
    [
        "comms_config",
        "monitor_config",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "flops_profiler",
        "comms_logger",
    ],
)
def test_deepspeed_sections_reported_once_as_ignored(key: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiered.config"):
        load_config({key: {"enabled": True}})
        load_config({key: {"enabled": True}})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and repr(key) in r.getMessage()]
    assert len(warnings) == 1 and "no effect in tiered" in warnings[0].getMessage()


def test_disabled_logger_is_not_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tiered.config"):
        load_config({"tensorboard": {"enabled": False, "output_path": "x"}})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "'tensorboard' accepted and ignored" in caplog.text


def test_settings_that_change_what_runs_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"compile\.deepcompile = True.*DeepCompile"):
        load_config({"compile": {"deepcompile": True}})
    with pytest.raises(UnsupportedConfigError, match=r"tensor_parallel\.autotp_size = 2.*AutoTP"):
        load_config({"tensor_parallel": {"autotp_size": 2}})
    with pytest.raises(UnsupportedConfigError, match=r"tensor_parallel\.tp\.tp_size = 4"):
        load_config({"tensor_parallel": {"tp": {"tp_size": 4}}})
    load_config(
        {"compile": {"deepcompile": False, "free_activation": True}, "tensor_parallel": {"autotp_size": 0}}
    )
    with pytest.raises(ConfigError, match=r"unknown configuration key 'compile.deepcompil'"):
        load_config({"compile": {"deepcompil": True}})


def test_zeros_keep_deepspeeds_meaning() -> None:
    z = load_config({ZP: {"stage": 3, "sub_group_size": 0}}).zero
    assert z.sub_group_size_numel == 1  # DeepSpeed: every parameter its own sub-group
    z = load_config(
        {ZP: {"stage": 3, "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 5e7}}
    ).zero
    assert (
        z.prefetch_bucket_size_numel == 0 and z.max_live_parameters_numel == sys.maxsize
    )  # prefetch-only limit
    z = load_config(
        {
            ZP: {
                "stage": 3,
                "stage3_prefetch_bucket_size": 0,
                "stage3_max_reuse_distance": 0,
                "stage3_param_persistence_threshold": 0,
            }
        }
    ).zero
    assert (
        z.prefetch_bucket_size_numel,
        z.max_reuse_distance_numel,
        z.param_persistence_threshold_numel,
    ) == (0, 0, 0)


@pytest.mark.parametrize(
    "path",
    [
        "zero_optimization.overlap_comm",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_optimizer.fast_init",
        "communication_data_type",
        "aio.single_submit",
        "aio.overlap_events",
    ],
)
def test_keys_nothing_reads_are_classed_accepted_with_a_reason(path: str) -> None:
    rule = config_keys.RULES[path]
    assert rule.kind == "accepted" and len(rule.note) > 20


def test_accepted_key_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tiered.config.keys"):
        load_config({ZP: {"stage": 3, "overlap_comm": True}})
    assert "'zero_optimization.overlap_comm' accepted and ignored: tiered's gathers" in caplog.text


def test_pin_memory_false_makes_the_cpu_tier_pageable() -> None:
    cfg = load_config({ZP: {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}})
    assert cfg.tiered.tiers["cpu"].backend == {"type": "cpu", "pin_memory": False}
    cfg = load_config({ZP: {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.tiered.tiers["cpu"].backend == {"type": "cpu"}
    # pin_memory of an inactive offload section changes nothing
    cfg = load_config({ZP: {"stage": 3, "offload_param": {"device": "none", "pin_memory": False}}})
    assert cfg.tiered.tiers["cpu"].backend == {"type": "cpu"}


class _Multimodal(torch.nn.Module):
    """Only text_config.hidden_size (16); the vision tower's Linear is 4x wider."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            text_config=SimpleNamespace(hidden_size=16), vision_config=SimpleNamespace()
        )
        self.vision = torch.nn.Linear(64, 64)
        self.text = torch.nn.Linear(16, 16)


def test_auto_for_multimodal_uses_text_config() -> None:
    cfg = load_config(
        {
            ZP: {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            }
        },
        model=_Multimodal(),
    )
    assert cfg.zero.reduce_bucket_size_numel == 16 * 16
    assert cfg.zero.prefetch_bucket_size_numel == int(0.9 * 16 * 16)
    assert cfg.zero.param_persistence_threshold_numel == 160


def test_steps_per_print_and_wall_clock_breakdown_are_honoured(caplog: pytest.LogCaptureFixture) -> None:
    from engine_support import MLP

    import tiered

    def mlp_batch(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(4, 16, generator=g), "y": torch.randn(4, 8, generator=g)}

    config = {
        ZP: {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
    }
    with caplog.at_level(logging.INFO, logger="tiered.engine"), tiered.initialize(MLP(), config) as engine:
        for i in range(4):
            engine.backward(engine(**mlp_batch(seed=i)))
            engine.step()
    progress = [
        r.getMessage() for r in caplog.records if r.name == "tiered.engine" and ": lr " in r.getMessage()
    ]
    timing = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tiered.engine" and " time: forward " in r.getMessage()
    ]
    assert [m.split(":")[0] for m in progress] == ["step 2", "step 4"]
    assert "lr 0.001" in progress[0] and "grad norm" in progress[0]
    assert [m.split(" time")[0] for m in timing] == ["step 2", "step 4"]
    caplog.clear()
    config["wall_clock_breakdown"] = False
    with caplog.at_level(logging.INFO, logger="tiered.engine"), tiered.initialize(MLP(), config) as engine:
        for i in range(2):
            engine.backward(engine(**mlp_batch(seed=i)))
            engine.step()
    assert " time: forward " not in caplog.text and "step 2: lr" in caplog.text


def test_docs_list_every_key() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text(encoding="utf-8")
    missing = [path for path in config_keys.RULES if f"`{path}`" not in doc]
    assert not missing, f"docs/config.md does not describe: {missing}"


@pytest.mark.parametrize("auto_cast", [True, False])
def test_fp16_auto_cast_is_honoured(auto_cast: bool) -> None:
    from engine_support import MLP

    import tiered

    seen: list[torch.dtype] = []
    model = MLP()
    model.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(kwargs["x"].dtype), with_kwargs=True)
    config = {
        ZP: {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "auto_cast": auto_cast},
    }
    with tiered.initialize(model, config) as engine:
        try:
            engine(x=torch.randn(4, 16), y=torch.randn(4, 8, dtype=torch.float16))
        except (RuntimeError, TypeError):
            assert not auto_cast  # fp32 inputs into fp16 weights: the user's to cast, as in DeepSpeed
    assert seen == [torch.float16 if auto_cast else torch.float32]
    from tiered.engine.inputs import cast_floating

    out = cast_floating({"a": [torch.ones(1)], "ids": torch.arange(2)}, torch.float16)
    assert out["a"][0].dtype == torch.float16 and out["ids"].dtype == torch.int64  # token ids untouched
