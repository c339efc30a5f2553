"""tiered.finetune's inputs: byte tokenizer, batch stream, model building and weight loading,
and the errors each gives on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered.errors import ConfigError
from tiered.finetune import ByteTokenizer, batches, build_model, load_tokens, resolve_model, tokenizer_for

TINY = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def write_model(folder: Path, **overrides: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return folder


# ---- byte tokenizer --------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer(256)
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_ids_are_byte_values() -> None:
    assert ByteTokenizer(300).encode("Aé") == [65, 0xC3, 0xA9]


def test_byte_tokenizer_rejects_small_vocab() -> None:
    with pytest.raises(ConfigError, match=r"vocab_size >= 256.*vocab_size is 64"):
        ByteTokenizer(64)


def test_byte_tokenizer_decode_rejects_non_bytes() -> None:
    with pytest.raises(ValueError, match="0..255"):
        ByteTokenizer(512).decode([65, 300])


def test_folder_without_tokenizer_files_gets_byte_tokenizer(tmp_path: Path) -> None:
    assert isinstance(tokenizer_for(write_model(tmp_path / "m"), 256), ByteTokenizer)
    assert isinstance(tokenizer_for(None, 256), ByteTokenizer)


# ---- data ------------------------------------------------------------------------------------
def test_load_tokens_reads_utf8(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("héllo", encoding="utf-8")
    ids = load_tokens(f, ByteTokenizer(256), 256)
    assert ids.dtype == torch.long and ids.tolist() == list("héllo".encode())


def test_load_tokens_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match=r"--data .*nope\.txt: no such file"):
        load_tokens(missing, ByteTokenizer(256), 256)
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"ok \xff\xfe")
    with pytest.raises(ConfigError, match=r"bin\.txt: not UTF-8"):
        load_tokens(bad, ByteTokenizer(256), 256)


def test_batches_are_windows_of_the_data_and_reproducible() -> None:
    ids = torch.arange(100)
    a = [next(s) for s in [batches(ids, 8, 3, seed=5)] for _ in range(4)]
    b = [next(s) for s in [batches(ids, 8, 3, seed=5)] for _ in range(4)]
    c = next(batches(ids, 8, 3, seed=6))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
    assert not torch.equal(a[0]["input_ids"], c["input_ids"])
    for bt in a:
        x = bt["input_ids"]
        assert x.shape == (3, 8) and torch.equal(bt["labels"], x)
        # arange data: every row is a contiguous window
        assert torch.equal(x - x[:, :1], torch.arange(8).expand(3, 8))
        assert int(x.max()) < 100


def test_batches_errors() -> None:
    with pytest.raises(ConfigError, match=r"corpus\.txt has 5 tokens, fewer than --seq-len 8"):
        next(batches(torch.arange(5), 8, 1, 0, source="corpus.txt"))
    with pytest.raises(ConfigError, match="--seq-len must be >= 2"):
        next(batches(torch.arange(5), 1, 1, 0))
    with pytest.raises(ConfigError, match="--batch-size must be >= 1"):
        next(batches(torch.arange(5), 2, 0, 0))


# ---- model -----------------------------------------------------------------------------------
def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--model .*missing: no such file or folder"):
        resolve_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="folder has no config.json"):
        resolve_model(tmp_path / "empty")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match=r"c\.json: config has no \"model_type\""):
        build_model(resolve_model(cfg))
    cfg.write_text("{not json")
    with pytest.raises(ConfigError, match=r"c\.json: not a readable JSON config"):
        build_model(resolve_model(cfg))


def test_a_folder_whose_weights_tiered_cannot_read_is_refused_not_trained_from_random(tmp_path: Path) -> None:
    """A folder as people have them: PyTorch .bin weights only, or an index whose shards never
    arrived. Either used to build a randomly initialised model and train it without a word."""
    from tiered.errors import WeightsError
    from tiered.zero.load import WeightSource

    config = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text(json.dumps(config))
    (bins / "pytorch_model-00001-of-00002.bin").write_bytes(b"pickle")
    (bins / "pytorch_model-00002-of-00002.bin").write_bytes(b"pickle")
    (bins / "pytorch_model.bin.index.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"pytorch_model-00001-of-00002\.bin.*does not read.*random weights"
    ) as e:
        resolve_model(bins)
    assert "save_pretrained" in str(e.value)  # how to convert it
    assert resolve_model(bins, weights=False).weight_files == ()  # tiered plan reads the shapes only
    with pytest.raises(WeightsError, match=r"no \*\.safetensors.*pytorch_model-00001-of-00002\.bin"):
        WeightSource(bins)  # the Python API's streamed load says the same
    shardless = tmp_path / "shardless"
    shardless.mkdir()
    (shardless / "config.json").write_text(json.dumps(config))
    (shardless / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ConfigError, match="none of its \\*\\.safetensors shards: the download is incomplete"):
        resolve_model(shardless)
    quantized = tmp_path / "gptq"
    quantized.mkdir()
    (quantized / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "gptq"}})
    )
    (quantized / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="a quantized checkpoint .*'gptq'.*original"):
        resolve_model(quantized)
    bare = tmp_path / "bare"  # config.json alone: a model initialised from the seed, as documented
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(config))
    assert resolve_model(bare).weight_files == ()


def test_a_loaded_model_reads_the_files_the_streamed_load_reads(tmp_path: Path) -> None:
    """--lora and --compare-torch load the weights into a real model: they read every
    *.safetensors of the folder, so a stale model.safetensors beside an index and its shards
    overrode the shards without a word, and a Mistral-style consolidated.safetensors was refused.
    They follow the index now, as [Note: streaming load] does; a tensor in two unindexed files
    is an error naming both."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    want = AutoModelForCausalLM.from_config(hf)
    folder = tmp_path / "m"
    want.save_pretrained(folder, max_shard_size="8KB")
    assert (folder / "model.safetensors.index.json").is_file()
    save_file(
        {k: torch.ones_like(v) for k, v in want.state_dict().items()}, str(folder / "model.safetensors")
    )
    save_file({"tok_embeddings.weight": torch.zeros(4)}, str(folder / "consolidated.safetensors"))
    source = resolve_model(folder)
    assert "model.safetensors" not in {f.name for f in source.weight_files}
    got = build_model(source)
    for k, v in want.state_dict().items():
        assert torch.equal(got.state_dict()[k], v.float()), k
    twice = tmp_path / "twice"  # no index, no Hugging Face names: every file is read
    twice.mkdir()
    (twice / "config.json").write_text((folder / "config.json").read_text())
    sd = {k: v.contiguous() for k, v in want.state_dict().items()}
    save_file(sd, str(twice / "a.safetensors"))
    save_file({"lm_head.weight": sd["lm_head.weight"]}, str(twice / "b.safetensors"))
    with pytest.raises(ConfigError, match=r"lm_head\.weight is in both a\.safetensors and b\.safetensors"):
        build_model(resolve_model(twice))


def test_build_model_from_config_is_seeded_fp32(tmp_path: Path) -> None:
    src = resolve_model(write_model(tmp_path / "m"))
    a, b, c = build_model(src, seed=1), build_model(src, seed=1), build_model(src, seed=2)
    assert type(a).__name__ == "LlamaForCausalLM" and a.training
    assert all(p.dtype == torch.float32 for p in a.parameters())
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_bare_config_json_builds(tmp_path: Path) -> None:
    write_model(tmp_path / "m")
    model = build_model(resolve_model(tmp_path / "m" / "config.json"))
    assert model.config.hidden_size == 32


def test_safetensors_weights_are_loaded(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = write_model(tmp_path / "m")
    donor = build_model(resolve_model(folder), seed=123)
    save_file({k: v.contiguous() for k, v in donor.state_dict().items()}, str(folder / "model.safetensors"))
    src = resolve_model(folder)
    assert [p.name for p in src.weight_files] == ["model.safetensors"]
    got = build_model(src, seed=0)  # a different seed: only the file can make them equal
    for n, p in donor.named_parameters():
        assert torch.equal(dict(got.named_parameters())[n], p), n


def test_safetensors_errors_name_the_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = write_model(tmp_path / "m")
    donor = build_model(resolve_model(folder))
    sd = {k: v.contiguous() for k, v in donor.state_dict().items()}
    save_file({**sd, "extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(
        ConfigError,
        match=r"1 tensors the model does not have, e\.g\. extra\.weight \(in model\.safetensors\)",
    ):
        build_model(resolve_model(folder))
    del sd["lm_head.weight"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"do not cover 1 parameters.*lm_head\.weight"):
        build_model(resolve_model(folder))
    sd["lm_head.weight"] = torch.zeros(3, 3)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"tensor lm_head\.weight has shape \(3, 3\)"):
        build_model(resolve_model(folder))


def test_tied_embeddings_need_no_lm_head_in_the_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = write_model(tmp_path / "m", tie_word_embeddings=True)
    donor = build_model(resolve_model(folder), seed=9)
    sd = {k: v.contiguous() for k, v in donor.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(folder / "model.safetensors"))  # as Hugging Face saves tied models
    got = build_model(resolve_model(folder), seed=0)
    assert got.lm_head.weight is got.model.embed_tokens.weight
    assert torch.equal(got.lm_head.weight, donor.model.embed_tokens.weight)


def write_word_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "fast": 2, "place": 3, "is": 4, "small": 5, ".": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )


def test_folder_tokenizer_is_used_instead_of_bytes(tmp_path: Path) -> None:
    folder = write_model(tmp_path / "m", vocab_size=16)  # < 256: fine with its own tokenizer
    write_word_tokenizer(folder)
    tok = tokenizer_for(folder, 16)
    assert not isinstance(tok, ByteTokenizer)
    data = tmp_path / "d.txt"
    data.write_text("the fast place is small. odd")
    assert load_tokens(data, tok, 16).tolist() == [1, 2, 3, 4, 5, 6, 0]
    with pytest.raises(ConfigError, match=r"d\.txt: tokenizer .* produced id 6 >= the model's vocab_size 4"):
        load_tokens(data, tok, 4)
