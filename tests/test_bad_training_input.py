"""Bad training input met by a clear error naming it, before anything trains or is lost: inputs
in a dtype the model does not compute in or on the meta device, an empty batch, a model with
no parameters, a data row nested past the parser's depth, a trace path that cannot be written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import CASES, build, ds_config, make_batches
from torch import nn

import tiered
from tiered.errors import ConfigError, InputDtypeError, InputError


@pytest.mark.parametrize(
    "dtype,x",
    [
        ("fp32", torch.randn(4, 16, dtype=torch.float64)),
        ("fp32", torch.ones(4, 16, dtype=torch.int64)),
        ("bf16", torch.ones(4, 16, dtype=torch.int64)),
    ],
    ids=["float64-into-fp32", "int64-into-fp32", "int64-into-bf16"],
)
def test_an_input_in_the_wrong_dtype_names_the_input_both_dtypes_and_the_fix(
    dtype: str, x: torch.Tensor
) -> None:
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    with tiered.initialize(build(CASES["mlp"]), ds_config(dtype=dtype)) as engine:
        with pytest.raises(InputDtypeError) as info:
            engine(x=x, y=torch.randn(4, 8, dtype=want))
    msg = str(info.value)
    assert f"MLP.forward: input 'x' is {x.dtype}" in msg and f".to({want})" in msg, msg


def test_an_input_on_the_meta_device_is_refused_by_name() -> None:
    with tiered.initialize(build(CASES["mlp"]), ds_config()) as engine:
        with pytest.raises(InputError, match=r"MLP.forward: input 'x' is on the meta device"):
            engine(x=torch.empty(4, 16, device="meta"), y=torch.randn(4, 8))


def test_an_empty_batch_is_refused_by_name_and_not_counted() -> None:
    case = CASES["mlp"]
    with tiered.initialize(build(case), ds_config()) as engine:
        with pytest.raises(InputError, match=r"the batch is empty \(input 'x' has shape \(0, 16\)\)"):
            engine(x=torch.randn(0, 16), y=torch.randn(0, 8))
        b = make_batches(case, 1, 4)[0]
        engine.backward(engine(**b))
        engine.step()
        assert engine.global_steps == 1 and engine.skipped_steps == 0


def test_a_size_0_dimension_that_is_not_the_batch_is_fine() -> None:
    """An empty cache-like input (0 along a later dimension) next to a real batch."""

    class WithCache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            return self.lin(x).mean() + cache.sum()

    with tiered.initialize(WithCache(), ds_config()) as engine:
        engine.backward(engine(torch.randn(2, 4), torch.zeros(2, 0, 3)))
        engine.step()


def test_a_module_without_parameters_is_not_called_frozen() -> None:
    class NoParams(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    with pytest.raises(ConfigError) as info:
        tiered.initialize(NoParams(), ds_config())
    msg = str(info.value)
    assert "NoParams has no parameters" in msg and "frozen" not in msg, msg


# ---- data rows --------------------------------------------------------------------------------
def _read(path: Path) -> list[Any]:
    from tiered.finetune.data_sources import read_records

    return list(read_records(path))


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_a_deeply_nested_data_row_names_the_file_and_line(tmp_path: Path, suffix: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    p = tmp_path / f"rows.{suffix}"
    if suffix == "jsonl":
        p.write_text('{"text": "fine"}\n' + deep + "\n")
    else:  # a JSON array of rows, the deep one on line 3
        p.write_text('[\n{"text": "fine"},\n' + deep + "\n]\n")
    with pytest.raises(ConfigError) as info:
        _read(p)
    msg = str(info.value)
    line = 2 if suffix == "jsonl" else 3
    assert f"{p}:{line}: JSON nested too deeply" in msg, msg


# ---- trace path -------------------------------------------------------------------------------
def test_a_trace_path_in_a_missing_folder_fails_at_initialize(tmp_path: Path) -> None:
    cfg = ds_config()
    cfg["tiered"] = {"trace_path": str(tmp_path / "gone" / "trace.json")}
    with pytest.raises(ConfigError, match=r"tiered.trace_path = .*gone.*does not exist"):
        tiered.initialize(build(CASES["mlp"]), cfg)
    cfg["tiered"] = {"trace_path": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"tiered.trace_path = .* is a folder"):
        tiered.initialize(build(CASES["mlp"]), cfg)


def test_finetune_refuses_a_config_trace_path_in_a_missing_folder_before_building(tmp_path: Path) -> None:
    from test_finetune import TEXT, TINY
    from test_finetune import ds_config as ft_config

    from tiered.cli.finetune import finetune_job
    from tiered.cli.finetune.options import FinetuneOptions

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = {**ft_config(tmp_path / "nvme"), "tiered": {"trace_path": str(tmp_path / "no" / "t.json")}}
    with pytest.raises(ConfigError, match=r"tiered.trace_path = .*no.*does not exist"):
        finetune_job(
            FinetuneOptions(
                model_path=model, config=cfg, data_path=tmp_path / "corpus.txt", seq_len=16, steps=1
            )
        )
    assert not (tmp_path / "nvme").exists()  # refused before anything was set up
