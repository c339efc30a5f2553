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
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_state_dict_is_deepspeeds_placeholders_that_cannot_be_saved(opened, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A module's state_dict() under ZeRO-3 gives what DeepSpeed's gives: every key, each
    parameter an empty placeholder; writing it (torch.save, safetensors) raises instead of
    saving empty tensors."""
    import io

    from safetensors.torch import save_file

    model, _, _ = opened
    sd = model.state_dict()
    params = dict(model.named_parameters())
    assert set(params) <= set(sd)
    assert all(sd[n].shape == (0,) for n in params)
    with pytest.raises(ParameterNotGatheredError, match=r"engine\.gathered_parameters"):
        torch.save(sd, io.BytesIO())
    with pytest.raises(ParameterNotGatheredError, match=r"engine\.gathered_parameters"):
        save_file({n: sd[n] for n in params}, str(tmp_path / "sd.safetensors"))
    with pytest.raises(ParameterNotGatheredError):
        sd["lm_head.weight"].sum()


def test_close_gives_ordinary_parameters_back(tmp_path: Path) -> None:
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=3)
    want = model.lm_head.weight.detach().clone()
    engine = tiered.initialize(model, ds_config(tmp_path / "nvme", param="cpu", opt="cpu"))
    engine.close()
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert torch.equal(model.lm_head.weight.detach(), want)
    assert float(model.lm_head.weight.sum()) == float(want.sum())


def test_every_way_to_the_values_of_a_released_parameter_raises(opened, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``.data`` (and ``.T``, ...) hand out the empty placeholder guarded: reading values through
    them, copying or pickling the parameter raises instead of seeing an empty tensor."""
    import copy
    import io
    import pickle

    import numpy as np

    model, _, _ = opened
    w = model.lm_head.weight
    reads = {
        "data.sum": lambda: w.data.sum(),
        "data.clone": lambda: w.data.clone(),
        "data.numpy": lambda: w.data.numpy(),
        "data.tolist": lambda: w.data.tolist(),
        "data.float16": lambda: w.data.to(torch.float16),
        "data.copy_": lambda: w.data.copy_(torch.ones(1)),
        "data.normal_": lambda: w.data.normal_(),
        "data.data.sum": lambda: w.data.data.sum(),
        "data.T.sum": lambda: w.data.T.sum(),
        "T.sum": lambda: w.T.sum(),
        "mT.clone": lambda: w.mT.clone(),
        "equal": lambda: torch.equal(w.data, torch.zeros(0)),
        "np.asarray(data)": lambda: np.asarray(w.data),
        "np.asarray": lambda: np.asarray(w),
        "detach().sum": lambda: w.detach().sum(),
        "detach().clone": lambda: w.detach().clone(),
        "init.normal_": lambda: torch.nn.init.normal_(w),
        "deepcopy": lambda: copy.deepcopy(w),
        "deepcopy(model)": lambda: copy.deepcopy(model),
        "pickle": lambda: pickle.dumps(w),
        "torch.save": lambda: torch.save(w, io.BytesIO()),
        "torch.save(state_dict(keep_vars))": lambda: torch.save(
            model.state_dict(keep_vars=True), io.BytesIO()
        ),
        "parameters_to_vector": lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
        "save_pretrained(bin)": lambda: model.save_pretrained(tmp_path / "bin", safe_serialization=False),
    }
    for what, read in reads.items():
        with pytest.raises(ParameterNotGatheredError, match=r"engine\.gathered_parameters") as exc:
            read()
        assert "tiered's ZeRO-3 engine" in str(exc.value), what
    assert not (tmp_path / "bin" / "pytorch_model.bin").exists()
    # metadata of .data stays readable (accelerate, peft and the engine read it)
    d = w.data
    assert d.shape == (0,) and d.dtype == torch.float32 and d.device == w.device and d.numel() == 0
    assert d.to(w.device) is d and d.data is d and w.grad is None


def test_data_inside_gathered_parameters_is_the_values(opened) -> None:  # type: ignore[no-untyped-def]
    import copy

    model, engine, want = opened
    w = model.lm_head.weight
    with engine.gathered_parameters(model.lm_head):
        assert type(w.data) is torch.Tensor and torch.equal(w.data, want)
        assert torch.equal(w.data.clone(), want) and torch.equal(copy.deepcopy(w).detach(), want)
        assert torch.equal(w.T.t(), want)
    with pytest.raises(ParameterNotGatheredError):
        w.data.sum()
    # generate runs the forward hooks, which gather: it works outside gathered_parameters
    out = model.generate(torch.randint(0, 256, (1, 4)), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 6)
