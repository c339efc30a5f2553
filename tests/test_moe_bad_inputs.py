"""Per-expert MoE folders that are incomplete, inconsistent or quantized: refused before anything
trains, each error naming the tensors and files ([Note: file tensors by transformers'
conversions])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from moe_support import config, write_folder

import tiered
from tiered.errors import WeightsError

EXPERT = "model.layers.1.mlp.experts.2.gate_proj.weight"


def _shard_of(folder: Path, key: str) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][key]


def _edit(folder: Path, key: str, fn) -> None:  # type: ignore[no-untyped-def]
    """Rewrite the shard holding `key` with `fn(tensors)` applied (the index left as it is)."""
    from safetensors.torch import load_file, save_file

    f = _shard_of(folder, key)
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _refused(tmp_path: Path, folder: Path) -> str:
    with pytest.raises(WeightsError) as info:
        tiered.from_pretrained(folder, config(tmp_path))
    return str(info.value)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_folder(tmp_path / "qwen3", "qwen3_moe", shard="8KB")


def test_an_expert_shard_the_index_names_but_the_folder_lacks_is_named(tmp_path, folder):
    shard = _shard_of(folder, EXPERT)
    shard.unlink()
    msg = _refused(tmp_path, folder)
    assert shard.name in msg and "incomplete" in msg


def test_an_expert_missing_from_its_shard_is_named_with_the_shard(tmp_path, folder):
    shard = _shard_of(folder, EXPERT)
    _edit(folder, EXPERT, lambda t: t.pop(EXPERT))
    msg = _refused(tmp_path, folder)
    assert "model.layers.1.mlp.experts.gate_up_proj" in msg and "expert(s) [2]" in msg
    assert EXPERT in msg and shard.name in msg  # the index puts it there, which lacks it


def test_an_expert_of_another_shape_is_named(tmp_path, folder):
    _edit(folder, EXPERT, lambda t: t.__setitem__(EXPERT, torch.zeros(8, 32)))
    msg = _refused(tmp_path, folder)
    assert "experts of unequal shapes" in msg and EXPERT in msg and "(8, 32)" in msg
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in msg  # what the others are


def test_experts_of_the_wrong_shape_for_the_config_are_named(tmp_path, folder):
    """Every expert consistently wider than config.json says: the assembled shape is named."""
    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        t = load_file(str(f))
        for k in [k for k in t if ".experts." in k and k.endswith("down_proj.weight")]:
            t[k] = torch.zeros(32, 24)
        save_file(t, str(f), metadata={"format": "pt"})
    msg = _refused(tmp_path, folder)
    assert "experts.down_proj" in msg and "(4, 32, 24)" in msg and "(4, 32, 16)" in msg


def test_a_file_with_both_per_expert_and_fused_names_is_refused_naming_both(tmp_path, folder):
    fused = "model.layers.0.mlp.experts.down_proj"
    _edit(folder, EXPERT, lambda t: t.__setitem__(fused, torch.zeros(4, 32, 16)))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][fused] = _shard_of(folder, EXPERT).name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _refused(tmp_path, folder)
    assert fused in msg and "model.layers.0.mlp.experts.0.down_proj.weight" in msg and "twice" in msg


def test_a_quantized_moe_checkpoint_is_refused_as_quantized(tmp_path, folder):
    """As config.json declares it (the Python API and the command line alike), and by its tensors
    where config.json does not (float8 experts with their scales)."""
    from tiered.errors import ConfigError
    from tiered.planning.hf_config import resolve_model

    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert "quantized checkpoint" in _refused(tmp_path, folder) and "'fp8'" in _refused(tmp_path, folder)
    with pytest.raises(ConfigError, match="quantized checkpoint"):
        resolve_model(folder)
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))

    def to_fp8(t: dict[str, torch.Tensor]) -> None:
        t[EXPERT] = t[EXPERT].to(torch.float8_e4m3fn)

    _edit(folder, EXPERT, to_fp8)
    msg = _refused(tmp_path, folder)
    assert "quantized checkpoint" in msg and EXPERT in msg and "float8" in msg

    _edit(folder, EXPERT, lambda t: t.__setitem__(EXPERT + "_scale_inv", torch.ones(1, 1)))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][EXPERT + "_scale_inv"] = _shard_of(folder, EXPERT).name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "quantization scale" in _refused(tmp_path, folder)
