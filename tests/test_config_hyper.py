"""Never invent a hyper-parameter: "auto" and a missing optimizer come from the caller or are an
error naming the key and the keyword (tiered.initialize) or flag (tiered finetune)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

import tiered
from tiered.config import Hyperparameters, dump_config, load_config
from tiered.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import MLP

ROOT = Path(__file__).resolve().parents[1]
ZERO3 = {"zero_optimization": {"stage": 3}}


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(4, 16, generator=g), "y": torch.randn(4, 8, generator=g)}


def test_no_optimizer_section_and_no_lr_is_refused_naming_the_key_and_keyword() -> None:
    cfg = load_config(ZERO3)
    assert cfg.unset == ("optimizer",)
    with pytest.raises(ConfigError, match=r"no optimizer section.*pass lr= to tiered.initialize"):
        tiered.initialize(MLP(), ZERO3)


def test_lr_auto_is_refused_naming_the_key() -> None:
    config = {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}}}
    with pytest.raises(
        ConfigError, match=r"optimizer\.params\.lr is \"auto\".*pass lr= to tiered.initialize"
    ):
        tiered.initialize(MLP(), config)
    # an optimizer section without an lr is the same: nobody chose one
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr"):
        tiered.initialize(MLP(), {**ZERO3, "optimizer": {"type": "AdamW"}})


def test_missing_optimizer_builds_adamw_from_exactly_the_callers_values() -> None:
    cfg = load_config(ZERO3, hyperparameters=Hyperparameters(lr=2e-4, betas=(0.8, 0.9)))
    o = cfg.optimizer
    assert (o.type, o.lr, o.betas, o.eps, o.weight_decay, o.adamw_mode) == (
        "AdamW",
        2e-4,
        (0.8, 0.9),
        1e-8,
        0.0,
        True,
    )
    cfg = load_config(ZERO3, hyperparameters=Hyperparameters(lr=1e-3, weight_decay=0.1))
    assert cfg.optimizer.weight_decay == 0.1 and cfg.unset == ()


def test_initialize_keywords_train_like_torch_adamw() -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = MLP()
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=5e-3, weight_decay=0.1)
    with tiered.initialize(model, ZERO3, lr=5e-3, weight_decay=0.1) as engine:
        assert engine.config.optimizer.lr == 5e-3
        for _ in range(2):
            engine.backward(engine(**_batch()))
            engine.step()
            opt.zero_grad()
            ref(**_batch()).backward()
            opt.step()
        got = engine.zero.gather_full_state_dict()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(got[name].float(), p, rtol=1e-5, atol=1e-6)


def test_hf_auto_config_filled_by_keywords() -> None:
    config = {
        **ZERO3,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "bf16": {"enabled": "auto"},
    }
    with pytest.raises(ConfigError) as info:
        tiered.initialize(MLP(), config, lr=1e-3)
    msg = str(info.value)
    for key, keyword in [
        ("scheduler.params.total_num_steps", "total_steps="),
        ("scheduler.params.warmup_num_steps", "warmup_steps="),
        ("train_micro_batch_size_per_gpu", "micro_batch_size="),
        ("gradient_accumulation_steps", "gradient_accumulation_steps="),
        ("gradient_clipping", "max_grad_norm="),
        ("bf16.enabled", "mixed_precision="),
        ("optimizer.params.weight_decay", "weight_decay="),
    ]:
        assert key in msg and keyword in msg, (key, msg)
    assert "optimizer.params.lr" not in msg
    kw = dict(
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-6,
        weight_decay=0.0,
        warmup_steps=3,
        total_steps=10,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        mixed_precision="no",
    )
    with tiered.initialize(MLP(), config, **kw) as engine:
        c = engine.config
        assert c.unset == ()
        assert c.scheduler is not None and c.scheduler.params["total_num_steps"] == 10
        assert c.scheduler.params["warmup_num_steps"] == 3 and c.scheduler.params["warmup_max_lr"] == 1e-3
        assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.train_batch_size) == (
            4,
            2,
            8,
        )
        assert c.gradient_clipping == 1.0 and c.optimizer.betas == (0.9, 0.95)


def test_a_caller_value_contradicting_the_config_is_refused_naming_both() -> None:
    config = {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0}
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr = 0\.0001 in the config but lr=0\.0002"):
        load_config(config, hyperparameters=Hyperparameters(lr=2e-4))
    with pytest.raises(ConfigError, match=r"gradient_clipping = 1\.0 in the config but max_grad_norm=0\.5"):
        load_config(config, hyperparameters=Hyperparameters(max_grad_norm=0.5))
    assert (
        load_config(config, hyperparameters=Hyperparameters(lr=1e-4)).optimizer.lr == 1e-4
    )  # agreeing is fine


def test_total_num_steps_auto_names_the_fix_initialize_can_follow() -> None:
    config = {
        **ZERO3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 2}},
    }
    with pytest.raises(
        ConfigError, match=r"total_num_steps is \"auto\": pass total_steps= to tiered.initialize"
    ):
        tiered.initialize(MLP(), config)
    with tiered.initialize(MLP(), config, total_steps=7) as engine:
        assert engine.config.scheduler is not None and engine.config.scheduler.params["total_num_steps"] == 7


def test_resolved_config_with_unset_keys_round_trips_and_takes_keywords() -> None:
    cfg = load_config({**ZERO3, "train_micro_batch_size_per_gpu": "auto"})
    assert set(cfg.unset) == {"optimizer", "train_micro_batch_size_per_gpu"}
    assert load_config(dump_config(cfg)) == cfg  # "auto" written back, never a placeholder
    with pytest.raises(ConfigError, match="micro_batch_size="):
        tiered.initialize(MLP(), cfg, lr=1e-3)
    with tiered.initialize(MLP(), cfg, lr=1e-3, micro_batch_size=2) as engine:
        assert engine.config.optimizer.lr == 1e-3 and engine.config.train_micro_batch_size_per_gpu == 2


def test_bad_keywords() -> None:
    with pytest.raises(TypeError, match=r"learning_rate.*lr, betas"):
        tiered.initialize(MLP(), ZERO3, learning_rate=1e-3)
    with pytest.raises(ConfigError, match=r"lr=.*out of range"):
        tiered.initialize(MLP(), ZERO3, lr=0.0)
    with pytest.raises(ConfigError, match="mixed_precision="):
        Hyperparameters(mixed_precision="fp8")  # type: ignore[arg-type]


def test_warmup_steps_without_a_scheduler_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="tiered.config"):
        load_config(ZERO3, hyperparameters=Hyperparameters(lr=1e-3, warmup_steps=5))
    assert "warmup_steps=5" in caplog.text and "no scheduler section" in caplog.text


def _finetune(config: dict, **kw: object) -> str:
    pytest.importorskip("transformers")
    from tiered.cli.finetune import finetune_job
    from tiered.cli.finetune.options import FinetuneOptions

    out = io.StringIO()
    finetune_job(
        FinetuneOptions(
            model_path=ROOT / "examples" / "tiny-llama",
            config=config,
            data_path=ROOT / "examples" / "corpus.txt",
            seq_len=16,
            batch_size=2,
            steps=1,
            **kw,  # type: ignore[arg-type]
        ),
        out,
    )
    return out.getvalue()


def test_finetune_names_the_flags() -> None:
    with pytest.raises(ConfigError, match="pass --lr"):
        _finetune(ZERO3)
    sched = {
        **ZERO3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    }
    with pytest.raises(ConfigError, match="pass --warmup-steps"):
        _finetune(sched)
    text = _finetune(ZERO3, lr=1e-3, weight_decay=0.1)
    assert "lr 0.001 (AdamW)" in text
    assert "step     1/1" in _finetune(sched, warmup_steps=2)


def test_mixed_precision_without_a_precision_section_is_not_dropped() -> None:
    cfg = load_config(ZERO3, hyperparameters=Hyperparameters(lr=1e-3, mixed_precision="bf16"))
    assert cfg.precision.dtype == torch.bfloat16
    cfg = load_config(
        {**ZERO3, "fp16": {"loss_scale": 0}}, hyperparameters=Hyperparameters(lr=1e-3, mixed_precision="fp16")
    )
    assert cfg.precision.dtype == torch.float16
    with pytest.raises(ConfigError, match=r"bf16\.enabled = False in the config but mixed_precision='bf16'"):
        load_config(
            {**ZERO3, "bf16": {"enabled": False}},
            hyperparameters=Hyperparameters(lr=1e-3, mixed_precision="bf16"),
        )


def test_warmup_min_lr_is_filled_only_where_auto() -> None:
    sched = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 2},
    }
    cfg = load_config({**ZERO3, "scheduler": sched}, hyperparameters=Hyperparameters(lr=1e-3))
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_min_lr"] == 1e-4
