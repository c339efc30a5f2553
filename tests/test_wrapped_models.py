"""Multimodal `*ForConditionalGeneration` folders fine-tuned on text through the command line
([Note: wrapped models train their language model]): the language model trains, the other
towers are frozen and kept, and the export loads as the original class with the trained logits;
a wrapper that cannot train on text is refused by `tiered plan` and `tiered finetune` alike,
naming the class. And `--lora` on an MoE folder, its experts included, with the merged export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from finetune_support import ds_config
from moe_support import saved_keys, write_folder

from tiered.cli.main import main

TINY_TEXT = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, max_position_embeddings=64,
)  # fmt: skip
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)


def _run(tmp_path: Path, folder: Path, *extra: str) -> int:
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(tmp_path / "nvme", param="cpu", opt="cpu")))
    args = ["finetune", "--model", str(folder), "--config", str(cfg), "--data", str(data)]
    return main([*args, "--seq-len", "16", "--steps", "2", *extra])


def _check_export(folder: Path, out: Path, cls: Any) -> None:
    """The export loads as `cls` without a gap, the towers as they were, the language model trained."""
    assert saved_keys(out) == saved_keys(
        folder
    )  # the names transformers writes (the legacy layout of the wrapper)
    before = cls.from_pretrained(folder, dtype=torch.float32)
    after, info = cls.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    changed = {n for n, p in after.named_parameters() if not torch.equal(p, before.get_parameter(n))}
    assert changed and all(".language_model." in n or n.startswith("lm_head") for n in changed), changed
    assert not any("vision_tower" in n for n in changed)


def test_gemma3_as_shipped_trains_its_language_model_and_exports_the_wrapper(tmp_path, capsys):
    from transformers import Gemma3ForConditionalGeneration

    folder = write_folder(tmp_path / "gemma3", "gemma3", vocab=264)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"
    ]
    assert _run(tmp_path, folder, "--out", str(tmp_path / "run")) == 0
    out = capsys.readouterr().out
    assert "model: Gemma3ForConditionalGeneration" in out
    assert "frozen and kept: model.multi_modal_projector, model.vision_tower" in out
    assert 'AutoModelForCausalLM.from_pretrained("' in out
    _check_export(folder, tmp_path / "run" / "final", Gemma3ForConditionalGeneration)
    # tiered plan reads the nested text config and plans the same frozen towers
    assert main(["plan", "--model", str(folder), "--gpu-mem", "1GB", "--cpu-mem", "4GB", "--json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert 0 < doc["model"]["trainable_params"] < doc["model"]["total_params"]


def test_a_llava_folder_trains_and_its_load_line_names_the_class(tmp_path, capsys):
    """No AutoModelForCausalLM builds Llava: its own class does, from architectures[0]."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    cfg = LlavaConfig(
        text_config={"model_type": "llama", **TINY_TEXT},
        vision_config={"model_type": "clip_vision_model", **TINY_VISION, "projection_dim": 32},
        image_token_index=255,
    )
    folder = write_folder(tmp_path / "llava", "llava", config=cfg)
    assert _run(tmp_path, folder, "--out", str(tmp_path / "run")) == 0
    out = capsys.readouterr().out
    assert 'LlavaForConditionalGeneration.from_pretrained("' in out
    _check_export(folder, tmp_path / "run" / "final", LlavaForConditionalGeneration)


def test_a_wrapper_that_cannot_train_on_text_is_refused_by_plan_and_finetune(tmp_path, capsys):
    from transformers import Blip2Config

    cfg = Blip2Config(
        vision_config=TINY_VISION,
        qformer_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                            encoder_hidden_size=32),
        text_config={"model_type": "opt", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "ffn_dim": 64, "word_embed_proj_dim": 32},
        num_query_tokens=4,
    )  # fmt: skip
    cfg.architectures = ["Blip2ForConditionalGeneration"]
    folder = tmp_path / "blip2"
    folder.mkdir()
    cfg.to_json_file(str(folder / "config.json"))
    assert main(["plan", "--model", str(folder), "--gpu-mem", "1GB"]) == 2
    plan_err = capsys.readouterr().err
    assert _run(tmp_path, folder) == 2
    ft_err = capsys.readouterr().err
    for err in (plan_err, ft_err):
        assert (
            "Blip2ForConditionalGeneration cannot be fine-tuned on text" in err and "pixel_values" in err
        ), err


def test_cli_lora_on_an_moe_folder_trains_its_experts_and_merges(tmp_path, capsys):
    """`--lora` with attention and fused-expert targets on a per-expert Mixtral folder: equal to
    plain PyTorch (--compare-torch), the adapters exported in peft's format, and the merged model
    (--merge-lora) loads in transformers with the files' names."""
    from transformers import AutoModelForCausalLM

    folder = write_folder(tmp_path / "mixtral", "mixtral", vocab=256)
    spec = "r=4,targets=q_proj,v_proj,experts.gate_up_proj,experts.down_proj"
    assert (
        _run(
            tmp_path,
            folder,
            "--lora",
            spec,
            "--compare-torch",
            "--out",
            str(tmp_path / "run"),
            "--merge-lora",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "targets=q_proj,v_proj,experts.gate_up_proj,experts.down_proj" in out
    diff = float(out.split("max relative parameter difference: ")[1].split()[0])
    assert diff <= 1e-5
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    merged, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "final" / "merged", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    base = AutoModelForCausalLM.from_pretrained(folder)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(
        merged.get_parameter(name), base.get_parameter(name)
    )  # the experts' adapters merged


def test_the_config_tiered_plan_recommends_for_an_moe_folder_trains(tmp_path, capsys):
    """`--auto-config` (what `tiered plan --model` searches) on a per-expert Qwen3-MoE folder: the
    chosen config builds and trains (it was recommended, then refused, before MoE files loaded)."""
    folder = write_folder(tmp_path / "qwen3", "qwen3_moe", vocab=256)
    assert _run(tmp_path, folder, "--auto-config", "cpu_mem=4GiB,gpu_mem=1GiB") == 0
    out = capsys.readouterr().out
    assert "loss: first" in out and "weights from" in out
