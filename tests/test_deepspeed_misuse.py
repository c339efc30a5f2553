"""The DeepSpeed surface misused (issue 37, item 6): `zero.Init` with a config that is no dict or
path, or a malformed one; `GatheredParameters` given names or numbers; a `zero.Init` model run
before `initialize`. Each is an error naming the argument and DeepSpeed's documented form."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tiered.deepspeed as deepspeed
from tiered.errors import ConfigError, ModelNotInitializedError, UsageError


@pytest.mark.parametrize(
    "kw, error, said",
    [
        (
            {"config_dict_or_path": 42},
            UsageError,
            "zero.Init(config_dict_or_path=42): a config is a dict or the path",
        ),
        ({"config": [1]}, UsageError, "zero.Init(config=[1]): a config is a dict or the path"),
        (
            {"config_dict_or_path": {"zero_optimization": []}},
            ConfigError,
            "zero_optimization is [], not a JSON object",
        ),
        ({"config_dict_or_path": {"zero_optimization": {"stage": "3"}}}, ConfigError, "stage is '3'"),
        ({"config_dict_or_path": {"zero_optimization": {"stage": True}}}, ConfigError, "stage is True"),
    ],
    ids=["42", "list", "zero-list", "stage-text", "stage-bool"],
)
def test_zero_init_names_a_bad_config_and_deepspeeds_form(kw: dict[str, Any], error: type, said: str) -> None:
    with pytest.raises(error) as info:
        deepspeed.zero.Init(**kw)
    assert said in str(info.value)
    if error is UsageError:
        assert "DeepSpeed's form: deepspeed.zero.Init(config_dict_or_path=ds_config)" in str(info.value)


def test_zero_init_reads_a_config_path_as_a_regular_file_only(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "ds.json")
    with pytest.raises(ConfigError, match="is a FIFO, not a regular file"):
        deepspeed.zero.Init(config_dict_or_path=str(tmp_path / "ds.json"))


@pytest.mark.parametrize(
    "params, said",
    [
        ("a.weight", "params='a.weight'"),
        (5, "params=5"),
        (["a.weight"], "[..., 'a.weight', ...]"),
        ({"a": 1}, "params={'a': 1}"),
    ],
    ids=["name", "number", "list-of-names", "dict"],
)
def test_gathered_parameters_names_what_it_was_given_and_deepspeeds_form(params: Any, said: str) -> None:
    with pytest.raises(UsageError) as info:
        deepspeed.zero.GatheredParameters(params)
    assert said in str(info.value) and "DeepSpeed's form: GatheredParameters(model.layer.weight)" in str(
        info.value
    )


def test_gathered_parameters_refuses_a_modifier_rank_that_is_no_int() -> None:
    with pytest.raises(UsageError, match="modifier_rank='0'"):
        deepspeed.zero.GatheredParameters(torch.nn.Parameter(torch.ones(2)), modifier_rank="0")


def _built_under_init() -> torch.nn.Module:
    with deepspeed.zero.Init():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_zero_init_model_run_before_initialize_says_so(device: str) -> None:
    model = _built_under_init()
    with pytest.raises(ModelNotInitializedError, match="was built under deepspeed.zero.Init") as info:
        model(torch.ones(1, 4, device=device))  # on meta inputs torch would return meta outputs
    assert "deepspeed.initialize(model=model, config=ds_config), then engine(batch)" in str(info.value)


def test_the_same_model_runs_through_the_engine_and_a_model_built_outside_is_untouched() -> None:
    model = _built_under_init()
    engine, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3},
        },
    )
    with engine:
        y = engine(torch.ones(1, 4))
        engine.backward(y.square().sum())
        engine.step()
        assert bool(torch.isfinite(y).all())
    plain = torch.nn.Linear(4, 2)  # built outside any Init: no hook
    assert not plain._forward_pre_hooks
    assert plain(torch.ones(1, 4)).shape == (1, 2)
