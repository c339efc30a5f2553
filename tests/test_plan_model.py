"""`tiered plan --model`: parameters counted on the meta device equal the real model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiered.errors import ConfigError
from tiered.planning.model_shape import shape_from_model

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=False,
    )


def _tiny_gpt2() -> transformers.GPT2Config:
    # GPT-2 ties lm_head to the token embedding: counted once, as Module.parameters() does.
    return transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=500, n_positions=64)


def _real(config: transformers.PretrainedConfig) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    small = sum(p.numel() for p in model.parameters() if p.numel() <= 100_000)
    return total, largest, small


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gpt2], ids=["llama", "gpt2"])
def test_folder_count_equals_real_model(tmp_path: Path, make) -> None:
    config = make()
    config.save_pretrained(tmp_path)
    shape = shape_from_model(tmp_path)
    total, largest, small = _real(config)
    assert shape.total_params == total
    assert shape.largest_layer_params == largest
    assert shape.persistent_params == small
    assert shape.assumptions == ()
    assert type(transformers.AutoModelForCausalLM.from_config(config)).__name__ in shape.source


def test_llama_count_by_formula(tmp_path: Path) -> None:
    # Independent of transformers' own counting: embed + layers + norm + untied head.
    config = _tiny_llama()
    config.save_pretrained(tmp_path)
    h, i, v, layers, kv = 64, 176, 1000, 3, 2
    head_dim = h // 4
    attn = h * h + 2 * h * (kv * head_dim) + h * h
    per_layer = attn + 3 * h * i + 2 * h
    expected = v * h + layers * per_layer + h + v * h
    shape = shape_from_model(tmp_path)
    assert shape.total_params == expected
    assert shape.largest_layer_params == v * h  # the embedding (and the head)


def test_config_json_file_works_too(tmp_path: Path) -> None:
    config = _tiny_gpt2()
    config.save_pretrained(tmp_path)
    shape = shape_from_model(tmp_path / "config.json")
    assert shape.total_params == _real(config)[0]


def test_model_build_allocates_nothing(tmp_path: Path) -> None:
    # A 70B-shaped config is counted on the meta device in seconds, without 280 GB of RAM.
    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    config.save_pretrained(tmp_path)
    shape = shape_from_model(tmp_path)
    assert shape.total_params == 68_976_648_192  # Llama-2-70B
    assert shape.largest_layer_params == 8192 * 32000


def test_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file or folder") as info:
        shape_from_model(tmp_path / "nope")
    assert "nope" in str(info.value)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        shape_from_model(tmp_path)


def test_json_without_model_type(tmp_path: Path) -> None:
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ConfigError, match="model_type"):
        shape_from_model(f)


def test_unknown_model_type(tmp_path: Path) -> None:
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(ConfigError, match="not-a-model"):
        shape_from_model(f)


def test_not_json(tmp_path: Path) -> None:
    f = tmp_path / "cfg.json"
    f.write_text("{ nope")
    with pytest.raises(ConfigError, match="JSON"):
        shape_from_model(f)
