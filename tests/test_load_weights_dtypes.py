"""A floating-point parameter is filled only from a floating-point file tensor (issue 37, item 4):
an integer or boolean tensor in the safetensors files is refused naming tensor, file and dtype,
on the streamed load ([Note: streaming load]) and on the load into a real model (--lora,
--compare-torch); a float file of another width still loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import tiered
from tests.engine_support import ds_config
from tiered.cli.main import main
from tiered.errors import WeightsError
from tiered.testing.weights import write_random_weights

ROOT = Path(__file__).resolve().parent.parent


def _folder(tmp_path: Path, name: str, dtype: torch.dtype) -> Path:
    """A tiny Llama folder whose tensor `name` is stored as `dtype` (its values kept)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    folder = tmp_path / "model"
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    (shard,) = write_random_weights(folder, cfg, dtype=torch.float32, seed=3)
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(shard))
    return folder


@pytest.mark.parametrize(
    "dtype, code",
    [(torch.int32, "I32"), (torch.int64, "I64"), (torch.uint8, "U8"), (torch.bool, "BOOL")],
    ids=["int32", "int64", "uint8", "bool"],
)
def test_an_integer_or_boolean_tensor_for_a_float_parameter_is_refused_naming_it(
    tmp_path: Path, dtype: torch.dtype, code: str
) -> None:
    folder = _folder(tmp_path, "model.norm.weight", dtype)
    with pytest.raises(WeightsError) as info:
        tiered.from_pretrained(str(folder), ds_config(param="cpu", opt="cpu"))
    msg = str(info.value)
    assert "tensor model.norm.weight in" in msg and ".safetensors is stored as " + code in msg
    assert "float32 weight" in msg


def test_the_real_model_load_refuses_it_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--compare-torch loads the files into a real model first (finetune/model.py)."""
    folder = _folder(tmp_path, "model.layers.0.mlp.up_proj.weight", torch.int32)
    (tmp_path / "ds.json").write_text(json.dumps(ds_config(param="cpu", opt="cpu")))
    argv = ["finetune", "--model", str(folder), "--config", str(tmp_path / "ds.json"), "--data",
            str(ROOT / "examples" / "corpus.txt"), "--seq-len", "16", "--steps", "1", "--compare-torch"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "tensor model.layers.0.mlp.up_proj.weight in" in err
        and "is stored as I32 (int32), not floating point" in err
    )


def test_a_float_tensor_of_another_width_loads(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "model.norm.weight", torch.float64)
    with tiered.from_pretrained(str(folder), ds_config(param="cpu", opt="cpu")) as engine:
        assert engine.global_steps == 0
