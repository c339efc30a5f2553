"""LR schedules: values computed by hand from DeepSpeed's formulas (lr_schedules.py).

Indexing ([Note: scheduler step indexing]): lr_at(k) is the lr of the optimizer step taken after
k steps, i.e. DeepSpeed's get_lr() at last_batch_iteration i = k - 1.
"""

from __future__ import annotations

import pytest

from tiered.config import Hyperparameters, SchedulerConfig, load_config
from tiered.errors import ConfigError
from tiered.optim import build_scheduler
from tiered.optim.schedulers import ConstantLR, WarmupCosineLR


def _sched(type_, params, base_lr=1.0, total_steps=None):
    return build_scheduler(SchedulerConfig(type_, params), base_lr=base_lr, total_steps=total_steps)


def test_warmup_lr_log():
    s = _sched("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10})
    assert s.lr_at(0) == 0.0  # i = -1: min_lr
    assert s.lr_at(1) == 0.0  # i = 0: log(1)/log(10) = 0
    assert s.lr_at(2) == pytest.approx(0.01 * 0.3010299957)  # i = 1: log(2)/log(10)
    assert s.lr_at(5) == pytest.approx(0.01 * 0.6989700043)  # i = 4: log(5)/log(10)
    assert s.lr_at(10) == pytest.approx(0.01)  # i = 9: log(10)/log(10) = 1
    assert s.lr_at(11) == 0.01 and s.lr_at(10_000) == 0.01  # i >= W: max_lr


def test_warmup_lr_linear_with_min():
    s = _sched(
        "WarmupLR",
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.011, "warmup_num_steps": 10, "warmup_type": "linear"},
    )
    assert s.lr_at(0) == 0.001
    assert s.lr_at(1) == pytest.approx(0.001)  # i = 0: 0/10
    assert s.lr_at(6) == pytest.approx(0.006)  # i = 5: 0.001 + 0.010 * 0.5
    assert s.lr_at(10) == pytest.approx(0.010)  # i = 9: 0.001 + 0.010 * 0.9
    assert s.lr_at(11) == pytest.approx(0.011)


def test_warmup_num_steps_below_two_is_two():
    s = _sched("WarmupLR", {"warmup_max_lr": 0.5, "warmup_num_steps": 1})
    assert s.lr_at(1) == 0.0  # i = 0
    assert s.lr_at(2) == pytest.approx(0.5)  # i = 1: log(2)/log(2) = 1


def test_warmup_lr_ignores_optimizer_lr_but_defaults_to_it():
    explicit = _sched("WarmupLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 10}, base_lr=123.0)
    assert explicit.lr_at(50) == 0.02
    implicit = _sched("WarmupLR", {"warmup_num_steps": 10}, base_lr=3e-4)  # DeepSpeed: None -> optimizer lr
    assert implicit.lr_at(50) == 3e-4
    decay = _sched("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 10}, base_lr=3e-4)
    assert decay.lr_at(11) == pytest.approx(0.001)  # WarmupDecayLR's own default max


def test_warmup_decay_lr_linear():
    s = _sched(
        "WarmupDecayLR",
        {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.1,
            "warmup_num_steps": 10,
            "total_num_steps": 110,
            "warmup_type": "linear",
        },
    )
    assert s.lr_at(5) == pytest.approx(0.04)  # i = 4: 4/10
    assert s.lr_at(11) == pytest.approx(0.1)  # i = 10: (110-10)/(110-10)
    assert s.lr_at(61) == pytest.approx(0.05)  # i = 60: (110-60)/100
    assert s.lr_at(111) == 0.0  # i = 110: 0/100
    assert s.lr_at(500) == 0.0  # clamped at 0


def test_warmup_cosine_lr_linear():
    s = _sched(
        "WarmupCosineLR",
        {
            "total_num_steps": 110,
            "warmup_num_steps": 10,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
            "warmup_type": "linear",
        },
        base_lr=0.5,
    )
    assert s.lr_at(0) == 0.0  # i = -1: DeepSpeed returns 0.0
    assert s.lr_at(1) == pytest.approx(0.5 * 0.1)  # i = 0: 0.1 + 0.9 * 0
    assert s.lr_at(6) == pytest.approx(0.5 * 0.55)  # i = 5: 0.1 + 0.9 * 0.5
    # i = 10: p = (10-10+1)/100 = 0.01; (1+cos(0.01 pi))/2 = 0.9997532802; 0.01 + 0.99*that
    assert s.lr_at(11) == pytest.approx(0.5 * 0.9997557474)
    assert s.lr_at(60) == pytest.approx(0.5 * 0.505)  # i = 59: p = 0.5 -> 0.01 + 0.99 * 0.5
    assert s.lr_at(110) == pytest.approx(0.5 * 0.01)  # i = 109: p = 1
    assert s.lr_at(1000) == pytest.approx(0.5 * 0.01)  # clamped at cos_min_ratio


def test_warmup_cosine_defaults_log():
    s = _sched("WarmupCosineLR", {"total_num_steps": 2000}, base_lr=2.0)
    # defaults: warmup_min_ratio 0, warmup_num_steps 1000, cos_min_ratio 1e-4, log
    assert isinstance(s, WarmupCosineLR)
    assert (s.warmup_min_ratio, s.warmup_num_steps, s.cos_min_ratio, s.warmup_type) == (
        0.0,
        1000,
        0.0001,
        "log",
    )
    assert s.lr_at(101) == pytest.approx(2.0 * 0.6681071)  # log(101)/log(1000) = 4.61512/6.90776


def test_auto_params_from_config_and_total_steps():
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "warmup_min_lr": "auto",
                    "warmup_max_lr": "auto",
                    "warmup_num_steps": "auto",
                    "total_num_steps": "auto",
                },
            },
        }
    )
    # warmup_num_steps "auto" is the caller's (HF: warmup_steps), never an invented 1000: unset
    assert (
        cfg.scheduler.params["warmup_max_lr"] == 0.002 and cfg.scheduler.params["warmup_num_steps"] == "auto"
    )
    assert set(cfg.unset) == {"scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps"}
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "warmup_min_lr": "auto",
                    "warmup_max_lr": "auto",
                    "warmup_num_steps": "auto",
                    "total_num_steps": "auto",
                },
            },
        },
        hyperparameters=Hyperparameters(warmup_steps=1000),
    )
    assert cfg.scheduler.params["warmup_num_steps"] == 1000 and cfg.unset == (
        "scheduler.params.total_num_steps",
    )
    with pytest.raises(ConfigError, match=r"total_num_steps is \"auto\".*pass total_steps="):
        build_scheduler(cfg.scheduler, base_lr=cfg.optimizer.lr)
    s = build_scheduler(cfg.scheduler, base_lr=cfg.optimizer.lr, total_steps=3000)
    assert s.lr_at(2001) == pytest.approx(0.002 * (3000 - 2000) / (3000 - 1000))


def test_explicit_total_wins_over_total_steps():
    s = _sched(
        "WarmupDecayLR",
        {"total_num_steps": 20, "warmup_num_steps": 10, "warmup_max_lr": 1.0},
        total_steps=10_000,
    )
    assert s.lr_at(21) == 0.0


def test_no_scheduler_is_constant():
    s = build_scheduler(None, base_lr=0.25)
    assert isinstance(s, ConstantLR) and s.lr_at(0) == 0.25 and s.lr_at(999) == 0.25


def test_hand_made_config_is_normalized_and_validated():
    s = _sched("warmuplr", {}, base_lr=0.3)
    assert s.lr_at(5000) == 0.3
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps"):
        _sched("WarmupLR", {"warmup_num_steps": 0})
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps is required for WarmupCosineLR"):
        _sched("WarmupCosineLR", {})
    with pytest.raises(ConfigError, match="scheduler.params.warmup_type"):
        _sched("WarmupLR", {"warmup_type": "exp"})


def test_step_must_be_non_negative_int():
    s = _sched("WarmupLR", {})
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lr_at: step"):
            s.lr_at(bad)


@pytest.mark.parametrize(
    ("type_", "params", "base_lr"),
    [
        ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 7}, 0.5),
        ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}, 0.02),
        (
            "WarmupDecayLR",
            {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 5, "total_num_steps": 30},
            0.5,
        ),
        (
            "WarmupCosineLR",
            {
                "total_num_steps": 30,
                "warmup_num_steps": 6,
                "warmup_min_ratio": 0.2,
                "cos_min_ratio": 0.05,
                "warmup_type": "linear",
            },
            0.3,
        ),
    ],
)
def test_matches_deepspeed_engine_semantics(type_, params, base_lr):
    """Cross-check against DeepSpeed itself where it is installed (a benchmark peer, not a dependency):
    DeepSpeed's engine builds the scheduler, then calls scheduler.step() after each optimizer step."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    ds = getattr(lr_schedules, type_)(opt, **params)
    ours = _sched(type_, params, base_lr=base_lr)
    for step in range(40):
        assert ours.lr_at(step) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12), step
        ds.step()
