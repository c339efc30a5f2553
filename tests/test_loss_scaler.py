"""DynamicLossScaler follows deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler step by step."""

from __future__ import annotations

import pytest
import torch

from tiered.config.schema import PrecisionConfig
from tiered.errors import LossScaleError
from tiered.optim.clip import clip_coefficient, global_grad_norm
from tiered.optim.loss_scaler import DynamicLossScaler, StaticLossScaler, build_loss_scaler


def run(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for o in overflows:
        scaler.update(o)
        out.append(scaler.scale)
    return out


def test_hysteresis_delays_the_first_decrease_then_window_regrows() -> None:
    # Worked by hand from DeepSpeed's update_scale: hysteresis 2 absorbs the first overflow; the
    # second halves; after `window` iterations without overflow (counted from the last one) the
    # scale doubles and the hysteresis counter is reset.
    s = DynamicLossScaler(scale=16.0, window=3, hysteresis=2, min_scale=1.0)
    assert run(s, [True, True, False, False, False, False]) == [16.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    assert s.cur_hysteresis == 2


def test_hysteresis_one_halves_on_every_overflow_and_floors_at_min() -> None:
    s = DynamicLossScaler(scale=4.0, window=1000, hysteresis=1, min_scale=1.5)
    assert run(s, [True, True]) == [2.0, 1.5]
    with pytest.raises(LossScaleError, match="minimum"):
        s.update(True)


def test_clean_run_doubles_every_window() -> None:
    s = DynamicLossScaler(scale=1.0, window=2, hysteresis=2)
    assert run(s, [False] * 6) == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0]


def test_state_round_trip() -> None:
    a = DynamicLossScaler(scale=64.0, window=3, hysteresis=2)
    run(a, [True, False, True])
    b = DynamicLossScaler(scale=1.0, window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert run(a, [False, True, False]) == run(b, [False, True, False])


def test_build_from_precision_config() -> None:
    assert isinstance(build_loss_scaler(PrecisionConfig(dtype=torch.bfloat16)), StaticLossScaler)
    assert build_loss_scaler(PrecisionConfig(dtype=torch.float32)).scale == 1.0
    static = build_loss_scaler(PrecisionConfig(dtype=torch.float16, loss_scale=128.0))
    assert isinstance(static, StaticLossScaler) and static.scale == 128.0
    dyn = build_loss_scaler(
        PrecisionConfig(
            dtype=torch.float16, initial_scale_power=5, loss_scale_window=7, hysteresis=3, min_loss_scale=2.0
        )
    )
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.scale, dyn.window, dyn.hysteresis, dyn.min_scale) == (32.0, 7, 3, 2.0)


def test_bad_scaler_arguments_name_the_key() -> None:
    with pytest.raises(ValueError, match="loss_scale_window"):
        DynamicLossScaler(window=0)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ValueError, match="loss_scale"):
        StaticLossScaler(0.0)


def test_clip_coefficient_matches_torch_clip_grad_norm() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(37), torch.randn(5, 3)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, 0.5)
    sq = sum(float(g.double().pow(2).sum()) for g in grads)
    norm = global_grad_norm(sq)
    assert norm == pytest.approx(float(total), rel=1e-6)
    coef = clip_coefficient(norm, 0.5)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(g * coef, p.grad, rtol=1e-6, atol=0)
    assert clip_coefficient(0.1, 0.5) == 1.0  # below the threshold: untouched
    assert clip_coefficient(10.0, 0.0) == 1.0  # 0 disables clipping


def test_loss_scale_error_lives_with_the_other_errors_and_old_import_works() -> None:
    from tiered.errors import TieredError
    from tiered.optim import loss_scaler

    assert loss_scaler.LossScaleError is LossScaleError  # the old import path keeps working
    assert issubclass(LossScaleError, TieredError) and issubclass(LossScaleError, FloatingPointError)
