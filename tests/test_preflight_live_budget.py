"""The engine's pre-flight counts what the plan's GPU peak counts: the gathered parameters
``stage3_max_live_parameters`` keeps live beyond the largest module's gather ([Note: the live
budget searched], `tiered.planning.needs.live_budget_shortfall`). A budget that holds the gpu
tier's need but not the live bytes a config sets is refused naming the key and the largest value
that fits, with every other shortfall in the same refusal; DeepSpeed's default stays a cap the
budget enforces by evicting."""

from __future__ import annotations

import re

import pytest
import torch
from engine_support import ds_config

import tiered
from tiered.errors import CapacityError

LAYERS = 8
WIDTH = 256
LAYER_BYTES = WIDTH * WIDTH * 4  # fp32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def _config(gpu_budget: int, cpu_budget: int | None = None, max_live: int | None = None) -> dict[str, object]:
    extra = {} if max_live is None else {"stage3_max_live_parameters": max_live}
    return ds_config(
        param="cpu",
        opt="cpu",
        sub_group_size=WIDTH * WIDTH,
        gpu_budget=gpu_budget,
        cpu_budget=cpu_budget,
        extra_zero=extra,
    )


def test_live_bytes_beyond_the_gpu_budget_are_refused_by_key() -> None:
    # the gpu tier needs one layer's gather; a live budget of 6 layers keeps 6 of the 8
    budget = 3 * LAYER_BYTES
    with pytest.raises(CapacityError) as info:
        tiered.initialize(_model(), _config(budget, max_live=6 * WIDTH * WIDTH))
    msg = str(info.value)
    assert f"zero_optimization.stage3_max_live_parameters={6 * WIDTH * WIDTH}" in msg
    fits = int(re.search(r"stage3_max_live_parameters to at most (\d+)", msg).group(1))  # type: ignore[union-attr]
    assert fits == 3 * WIDTH * WIDTH  # the budget less the tier's need, plus the gather it counts
    # the value it names is accepted, and it trains
    with tiered.initialize(_model(), _config(budget, max_live=fits)) as engine:
        loss = engine(torch.randn(2, WIDTH)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def test_live_shortfall_is_listed_with_the_other_tiers() -> None:
    with pytest.raises(CapacityError) as info:
        tiered.initialize(_model(), _config(3 * LAYER_BYTES, LAYER_BYTES, max_live=6 * WIDTH * WIDTH))
    msg = str(info.value)
    assert "cpu budget" in msg and "stage3_max_live_parameters" in msg


def test_a_gpu_budget_with_room_for_the_live_bytes_is_accepted() -> None:
    tiered.initialize(_model(), _config(7 * LAYER_BYTES, max_live=6 * WIDTH * WIDTH)).close()


def test_deepspeeds_default_is_left_to_eviction_under_pressure() -> None:
    # DeepSpeed's 1e9 (and 0, no cap) over a model larger than the gpu budget: evicted as the
    # budget requires while it trains, as before, not refused
    for max_live in (None, 0):
        with tiered.initialize(_model(), _config(3 * LAYER_BYTES, max_live=max_live)) as engine:
            loss = engine(torch.randn(2, WIDTH)).pow(2).mean()
            engine.backward(loss)
            engine.step()
