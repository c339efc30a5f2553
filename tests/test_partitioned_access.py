"""Outside forward a partitioned parameter refuses to be read instead of looking empty (issue 10
item 6; [Note: partitioned parameters outside forward])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from finetune_support import ds_config, write_model
from torch import nn

import tiered
from tiered.errors import ParameterNotGatheredError
from tiered.finetune import build_model, resolve_model


@pytest.fixture()
def opened(tmp_path: Path):  # type: ignore[no-untyped-def]
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=3)
    want = model.lm_head.weight.detach().clone()
    engine = tiered.initialize(model, ds_config(tmp_path / "nvme", param="cpu", opt="cpu"))
    yield model, engine, want
    engine.close(restore_weights=False)


def test_reading_a_released_parameter_raises_with_the_fix(opened) -> None:  # type: ignore[no-untyped-def]
    model, engine, _ = opened
    w = model.lm_head.weight
    with pytest.raises(ParameterNotGatheredError, match=r"'lm_head.weight' .*engine.gathered_parameters"):
        w.sum()
    with pytest.raises(ParameterNotGatheredError, match="lm_head.weight"):
        torch.cat([w, w])
    with pytest.raises(ParameterNotGatheredError, match="lm_head.weight"):
        torch.nn.functional.linear(torch.ones(2, 32), w)
    # metadata stays readable: what the hooks, autograd and Hugging Face read
    assert isinstance(w, nn.Parameter) and w.numel() == 0 and w.dtype == torch.float32
    assert w.requires_grad and w.grad is None and model.dtype == torch.float32


def test_gathered_parameters_and_training_still_work(opened) -> None:  # type: ignore[no-untyped-def]
    model, engine, want = opened
    with engine.gathered_parameters(model.lm_head):
        assert torch.equal(model.lm_head.weight.detach(), want)
        assert float(model.lm_head.weight.sum()) == float(want.sum())
    x = torch.randint(0, 256, (2, 16))
    out = engine(input_ids=x, labels=x)
    engine.backward(out.loss)
    engine.step()
    assert torch.isfinite(out.loss)


def test_model_save_pretrained_names_engine_save_pretrained(opened, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, engine, _ = opened
    with pytest.raises(ParameterNotGatheredError, match=r"engine\.save_pretrained\(dir\)"):
        model.save_pretrained(tmp_path / "out")
    with pytest.raises(ParameterNotGatheredError):
        model.state_dict()


def test_close_gives_ordinary_parameters_back(tmp_path: Path) -> None:
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=3)
    want = model.lm_head.weight.detach().clone()
    engine = tiered.initialize(model, ds_config(tmp_path / "nvme", param="cpu", opt="cpu"))
    engine.close()
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert torch.equal(model.lm_head.weight.detach(), want)
    assert float(model.lm_head.weight.sum()) == float(want.sum())
