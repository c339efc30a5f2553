"""Streaming pretrained weights from safetensors shards into the tiers ([Note: streaming load])."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import tiered
from tests.engine_support import ds_config
from tiered.testing.weights import write_random_weights


def _llama_config(tie: bool = False, layers: int = 2, hidden: int = 32, inter: int = 64, vocab: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def _folder(tmp_path: Path, *, tie: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    folder = tmp_path / "model"
    write_random_weights(folder, _llama_config(tie), dtype=dtype, shard_bytes=8 << 10, seed=3)
    return folder


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _cfg(tmp_path: Path, **kw):
    kw.setdefault("param", "nvme")
    kw.setdefault("opt", "cpu")
    return ds_config(nvme_path=str(tmp_path / "nvme"), **kw)


def _batch(vocab: int = 64):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streamed_values_and_training_equal_plain_pytorch(tmp_path, dtype):
    """The partitions hold exactly the files' values (bf16 upcast), and two AdamW steps from them
    equal plain PyTorch AdamW from the same values (fp32 compute), or start from them (bf16)."""
    from transformers import LlamaForCausalLM

    folder = _folder(tmp_path)
    want = {k: v.float() for k, v in _file_tensors(folder).items()}
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # really sharded, through the index
    engine = tiered.from_pretrained(folder, _cfg(tmp_path, dtype=dtype))
    with engine:
        got = engine.zero.gather_full_state_dict()
        for k, v in want.items():
            torch.testing.assert_close(got[k].float(), v, rtol=0, atol=0, msg=k)
        losses = []
        for _ in range(2):
            loss = engine(**_batch()).loss
            losses.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        after = {k: v.float().clone() for k, v in engine.zero.gather_full_state_dict().items()}
    ref = LlamaForCausalLM(_llama_config())
    ref.config._attn_implementation = "eager"
    ref.load_state_dict(want, strict=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ref_losses = []
    for _ in range(2):
        loss = ref(**_batch()).loss
        ref_losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    # bf16: the fp32 master is read from the files (upcast), so only the forward's rounding differs
    rel = 1e-5 if dtype == "fp32" else 2e-3
    assert losses == pytest.approx(ref_losses, rel=rel)
    if dtype == "fp32":
        for k, p in ref.named_parameters():
            torch.testing.assert_close(after[k], p.detach(), rtol=1e-5, atol=1e-6, msg=k)


def test_tied_weights_are_covered_and_missing_ones_listed(tmp_path):
    folder = _folder(tmp_path, tie=True)
    assert "lm_head.weight" not in _file_tensors(folder)
    with tiered.from_pretrained(folder, _cfg(tmp_path)) as engine:
        sd = engine.zero.gather_full_state_dict()
        torch.testing.assert_close(
            sd["model.embed_tokens.weight"].float(),
            _file_tensors(folder)["model.embed_tokens.weight"].float(),
        )
    # drop a tensor from the index and its shard: an error naming it, unless init_missing
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    from safetensors.torch import load_file, save_file

    name = "model.layers.1.mlp.up_proj.weight"
    shard = folder / idx["weight_map"][name]
    rest = {k: v for k, v in load_file(str(shard)).items() if k != name}
    save_file(rest, str(shard))
    with pytest.raises(tiered.WeightsError, match=rf"puts {name} in {shard.name}, which lacks it"):
        tiered.from_pretrained(folder, _cfg(tmp_path))  # the index still names it: a stale shard, named
    idx["weight_map"].pop(name)
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(tiered.WeightsError, match=r"do not cover 1 parameters.*up_proj.*init_missing"):
        tiered.from_pretrained(folder, _cfg(tmp_path))
    with tiered.from_pretrained(folder, _cfg(tmp_path), init_missing=True) as engine:
        w = engine.zero.gather_full_state_dict()[name]
        assert torch.isfinite(w).all() and w.abs().sum() > 0  # initialised (HF init), not zeros


def test_index_errors_name_the_file(tmp_path):
    folder = _folder(tmp_path)
    index = folder / "model.safetensors.index.json"
    good = index.read_text()
    second = sorted(folder.glob("model-*.safetensors"))[1]
    second.rename(folder / "moved.bin")
    with pytest.raises(tiered.WeightsError, match=rf"{second.name}.*incomplete"):
        tiered.from_pretrained(folder, _cfg(tmp_path))
    (folder / "moved.bin").rename(second)
    index.write_text("{not json")
    with pytest.raises(tiered.WeightsError, match=r"model\.safetensors\.index\.json.*not a valid JSON"):
        tiered.from_pretrained(folder, _cfg(tmp_path))
    index.write_text(good)


def test_shape_mismatch_and_nan_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path)
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = folder / idx["weight_map"][name]
    tensors = load_file(str(shard))
    orig = tensors[name].clone()
    tensors[name] = torch.zeros(3, 5, dtype=torch.bfloat16)
    save_file(tensors, str(shard))
    with pytest.raises(tiered.WeightsError, match=r"q_proj\.weight.*shape \(3, 5\).*config\.json"):
        tiered.from_pretrained(folder, _cfg(tmp_path))
    bad = orig.clone()
    bad[7, 3] = float("nan")
    tensors[name] = bad
    save_file(tensors, str(shard))
    with pytest.raises(tiered.WeightsError, match=r"layers\.0\.self_attn\.q_proj\.weight.*NaN or Inf"):
        tiered.from_pretrained(folder, _cfg(tmp_path))


def test_stray_files_are_ignored_with_one_log_line(tmp_path, caplog):
    from safetensors.torch import save_file

    folder = _folder(tmp_path)
    want = _file_tensors(folder)
    poison = {k: torch.full_like(v, 7.0) for k, v in list(want.items())[:3]}
    save_file(poison, str(folder / "consolidated.safetensors"))
    with caplog.at_level(logging.INFO, logger="tiered.zero.load"):
        with tiered.from_pretrained(folder, _cfg(tmp_path)) as engine:
            sd = engine.zero.gather_full_state_dict()
    assert [r for r in caplog.records if "consolidated.safetensors" in r.getMessage()]
    for k in poison:
        torch.testing.assert_close(sd[k].float(), want[k].float())
    # no index: the Hugging Face shard names win over consolidated.safetensors, logged
    (folder / "model.safetensors.index.json").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiered.zero.load"):
        with tiered.from_pretrained(folder, _cfg(tmp_path)) as engine:
            sd = engine.zero.gather_full_state_dict()
    assert [r for r in caplog.records if "ignoring consolidated.safetensors" in r.getMessage()]
    for k in poison:
        torch.testing.assert_close(sd[k].float(), want[k].float())


def test_two_unindexed_files_with_one_tensor_are_refused(tmp_path):
    from safetensors.torch import save_file

    folder = _folder(tmp_path)
    (folder / "model.safetensors.index.json").unlink()
    for f in folder.glob("model-*.safetensors"):
        f.rename(folder / f.name.replace("model-", "part-"))
    k, v = next(iter(_file_tensors_glob(folder).items()))
    save_file({k: v}, str(folder / "old.safetensors"))
    with pytest.raises(tiered.WeightsError, match=rf"{k} is in both"):
        tiered.from_pretrained(folder, _cfg(tmp_path))


def _file_tensors_glob(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(sorted(folder.glob("part-*.safetensors"))[0]))


def test_cpu_budget_too_small_for_streaming_fails_before_writing(tmp_path):
    folder = _folder(tmp_path)
    nvme = tmp_path / "nvme"
    with pytest.raises(tiered.CapacityError, match=r"streaming weights .* needs [\d,]+ bytes"):
        tiered.from_pretrained(folder, _cfg(tmp_path, cpu_budget=1 << 20))
    assert not [p for p in nvme.rglob("*") if p.is_file()]  # nothing was written


def test_all_frozen_model_is_refused(tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_llama_config())
    model.requires_grad_(False)
    with pytest.raises(tiered.ConfigError, match="every parameter .* is frozen"):
        tiered.initialize(model, _cfg(tmp_path))


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, tiered
    from tests.engine_support import ds_config
    folder, nvme, cpu_b, gpu_b = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    base = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=nvme, sub_group_size=10**9,
                    gpu_budget=gpu_b, cpu_budget=cpu_b)
    from tiered.engine.pretrained import meta_causal_lm
    model = meta_causal_lm(folder)
    # gradients live in host memory when the optimizer is offloaded: train one matrix only, so the
    # CPU budget is about the load (the weights, on nvme, are 5x the budget)
    model.requires_grad_(False)
    model.model.layers[-1].mlp.down_proj.weight.requires_grad_(True)
    engine = tiered.initialize(model, cfg, weights=folder)
    peak_load = status("VmHWM:") - base
    ids = torch.randint(0, 256, (1, 16))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.close()
    print(json.dumps({"peak_load": peak_load, "loss": float(loss)}))
    """
)


def test_peak_rss_of_load_stays_within_the_budgets(tmp_path):
    """A model whose fp32 weights (~330 MB) exceed the CPU budget (64 MB) streams in with peak RSS
    within cpu + gpu budget + largest tensor + 1 GiB, and below the fp32 model (the old path
    materialised all of it, plus the files' tensors)."""
    cfg = _llama_config(layers=10, hidden=768, inter=2048, vocab=8192)
    cfg.num_attention_heads = cfg.num_key_value_heads = 12
    folder = tmp_path / "model"
    write_random_weights(folder, cfg, dtype=torch.bfloat16, shard_bytes=64 << 20)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    fp32_bytes = sum(p.numel() for p in meta.parameters()) * 4
    largest = max(p.numel() for p in meta.parameters()) * 4
    cpu_b, gpu_b = 64 << 20, 64 << 20
    assert fp32_bytes > 4 * cpu_b
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(folder), str(tmp_path / "nvme"), str(cpu_b), str(gpu_b)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    peak = out["peak_load"]
    assert peak <= cpu_b + gpu_b + largest + (1 << 30), out
    assert peak < cpu_b + gpu_b + largest + (128 << 20) < fp32_bytes, (peak, fp32_bytes)


def test_finetune_cli_streams_the_folder_weights(tmp_path, caplog):
    """`tiered finetune --model DIR` with shards streams them (no model is loaded whole first)
    and its losses equal the --compare-torch run, which loads the files into a real model first
    (by the same matching: both log the files they read)."""
    from tests.finetune_support import ds_config as ft_config
    from tiered.cli.main import main

    folder = tmp_path / "model"
    write_random_weights(folder, _llama_config(vocab=256), shard_bytes=16 << 10, seed=4)
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ft_config(tmp_path / "nvme")))
    docs = []
    for extra, streamed in (((), True), (("--compare-torch",), False)):
        stats = tmp_path / f"stats{len(docs)}.json"
        caplog.clear()
        args = ["finetune", "--model", str(folder), "--config", str(cfg), "--data", str(data)]
        args += ["--seq-len", "16", "--steps", "2", "--stats-json", str(stats), *extra]
        with caplog.at_level(logging.INFO, logger="tiered"):
            assert main(args) == 0
        said = [r.getMessage() for r in caplog.records]
        assert any("tensors in 5 files" in m for m in said)
        assert any(m.startswith("loaded 21 tensors from") for m in said) != streamed
        docs.append(json.loads(stats.read_text()))
    assert docs[0]["losses"] == pytest.approx(docs[1]["losses"], rel=1e-5)


def test_a_gemma_folder_streams_and_its_embedding_buffer_is_computed(tmp_path):
    """Gemma's embedding module also holds a buffer (embed_scale), computed by transformers' init
    of the whole module, which also zeroes the weight's padding row: run after the weight had
    become a storage-less placeholder, that init raised IndexError. The buffers are computed
    while the parameters are still meta now, and the first loss is transformers' own."""
    from transformers import AutoModelForCausalLM, GemmaConfig

    torch.manual_seed(0)
    hf = GemmaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    assert hf.pad_token_id == 0  # as real Gemma configs have it
    ref = AutoModelForCausalLM.from_config(hf, attn_implementation="eager")
    folder = tmp_path / "gemma"
    ref.save_pretrained(folder)
    want = float(ref(**_batch()).loss)
    with tiered.from_pretrained(folder, _cfg(tmp_path)) as engine:
        got = float(engine(**_batch()).loss)
    assert got == pytest.approx(want, rel=1e-5)


def _saved(folder, model) -> float:
    model.save_pretrained(folder)
    return float(model(**_batch()).loss)


def test_files_in_the_names_transformers_reads_stream_in(tmp_path):
    """Folders transformers loads without a missing or unexpected key: a GPT-2 saved from the
    base model (no "transformer." prefix) with the old attn.bias masks it ignores, and a
    GPT-NeoX whose head is embed_out on disk (transformers renames it lm_head). Both were
    refused as "weights of another config.json"; the first loss is transformers' own now."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2Model, GPTNeoXConfig

    torch.manual_seed(0)
    gpt2 = GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=1,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    base = GPT2Model(gpt2)
    folder = tmp_path / "gpt2"
    base.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    assert not any(k.startswith("transformer.") for k in tensors)
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    want = float(ref(**_batch()).loss)
    with tiered.from_pretrained(folder, _cfg(tmp_path)) as engine:
        assert float(engine(**_batch()).loss) == pytest.approx(want, rel=1e-5)

    neox = GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    model = AutoModelForCausalLM.from_config(neox, attn_implementation="eager")
    folder = tmp_path / "neox"
    want = _saved(folder, model)
    assert "embed_out.weight" in load_file(str(folder / "model.safetensors"))
    with tiered.from_pretrained(folder, _cfg(tmp_path)) as engine:
        assert float(engine(**_batch()).loss) == pytest.approx(want, rel=1e-5)


def test_a_conversion_the_streamed_load_cannot_follow_is_refused_naming_it(tmp_path):
    """transformers splits some families' fused files on load (Chunk, Transpose, ...), which a
    list of runs does not describe: refused naming the operation, never loaded wrong. (The
    per-expert merges of the MoE families load: tests/test_moe_families.py.)"""
    from safetensors.torch import load_file, save_file
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import Chunk, WeightConverter

    hf = _llama_config(layers=1)
    hf.num_key_value_heads = hf.num_attention_heads
    folder = tmp_path / "fused-qkv"
    write_random_weights(folder, hf, dtype=torch.float32, shard_bytes=1 << 30)
    f = next(folder.glob("model-*.safetensors"))
    t = load_file(str(f))
    att = "model.layers.0.self_attn."
    t[att + "qkv_proj.weight"] = torch.cat(
        [t.pop(att + n + ".weight") for n in ("q_proj", "k_proj", "v_proj")]
    )
    save_file(t, str(f), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").unlink()
    cm.register_checkpoint_conversion_mapping(
        "LlamaForCausalLM",
        [
            WeightConverter(
                "self_attn.qkv_proj.weight", [f"self_attn.{n}_proj.weight" for n in "qkv"], [Chunk(dim=0)]
            )
        ],
    )
    try:
        with pytest.raises(tiered.errors.WeightsError) as info:
            tiered.from_pretrained(folder, _cfg(tmp_path))
    finally:
        cm._checkpoint_conversion_mapping_cache.pop("LlamaForCausalLM", None)
        cm.USER_REGISTERED_MAPPINGS.discard("LlamaForCausalLM")
    msg = str(info.value)
    assert "Chunk" in msg and "qkv_proj" in msg and "not supported" in msg


def test_a_tied_model_whose_files_hold_both_names_says_which_one_it_takes(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, tie=True)
    files = sorted(folder.glob("model-*.safetensors"))
    last = load_file(str(files[-1]))
    last["lm_head.weight"] = torch.zeros_like(_file_tensors(folder)["model.embed_tokens.weight"])
    save_file(last, str(files[-1]))
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"]["lm_head.weight"] = files[-1].name
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    with caplog.at_level(logging.WARNING, logger="tiered"):
        with tiered.from_pretrained(folder, _cfg(tmp_path)):
            pass
    assert "ties lm_head.weight to model.embed_tokens.weight" in caplog.text
    assert "tie_word_embeddings false" in caplog.text
