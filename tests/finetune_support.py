"""Shared pieces of the fine-tuning tests: a tiny model folder with a byte-level chat tokenizer
built locally with `tokenizers` (nothing is downloaded), and a small ds_config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

TINY = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
SPECIALS = ["</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses: the
    vocabulary maps each character back to its byte value, so token id = byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_model(
    folder: Path, *, tokenizer: bool = True, chat_template: bool = True, **overrides: Any
) -> Path:
    """A config-only tiny Llama; with `tokenizer`, a byte-level BPE (no merges: one token per
    byte, ids 0..255) plus the chat special tokens (256..261), EOS `</s>` = 256."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **overrides}))
    if tokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE(vocab={c: b for b, c in byte_chars().items()}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(SPECIALS)
        tok.save(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
        if chat_template:
            cfg["chat_template"] = CHAT_TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def ds_config(nvme: Path, *, param: str = "nvme", opt: str = "nvme", micro: int = 2) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": 4000, "stage3_param_persistence_threshold": 0}
    if param != "none":
        zero["offload_param"] = {"device": param, **({"nvme_path": str(nvme)} if param == "nvme" else {})}
    if opt != "none":
        zero["offload_optimizer"] = {"device": opt, **({"nvme_path": str(nvme)} if opt == "nvme" else {})}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def checkpoint_job(tmp_path: Path, *, repeats: int) -> list[str]:
    """`tiered finetune` argv (no --steps / --out) for the checkpoint tests: the tiny model,
    parameters on NVMe and optimizer state on CPU, a WarmupLR scheduler (so resume must restore
    it too), and `repeats` copies of one sentence as the text data."""
    folder = write_model(tmp_path / "m")
    data = tmp_path / "d.txt"
    data.write_text("the fast place is small, the slow place is big. " * repeats)
    cfg = ds_config(tmp_path / "nvme", param="nvme", opt="cpu")
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    return [
        "finetune",
        "--model",
        str(folder),
        "--config",
        str(tmp_path / "ds.json"),
        "--data",
        str(data),
        "--seq-len",
        "16",
    ]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The full-model export a finished `--out` run wrote."""
    return load_file(str(out / "final" / "model.safetensors"))


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, fp32 (the export's dtype) and equal bit for bit: what a resumed run must give."""
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], want[k]), k
