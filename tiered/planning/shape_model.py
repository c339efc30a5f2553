"""A stand-in module tree for `tiered plan --params`: the group planner needs modules.

[Note: shape model for --params]
With only a parameter count N, the plan builds a dense Llama-style decoder on the meta device
(nothing allocated) and plans it exactly as it would a real model: hidden size h = the multiple
of 256 nearest (10.7 N)^(1/3) (depth h / 128, Llama-2's aspect ratio: 7B has h = 4096 and 32
layers), intermediate size 8h/3 rounded to 256, full multi-head attention, an untied 32,000-token
vocabulary (or, with ``--largest-layer L``, a vocabulary of L / h tokens, so the embedding is the
largest layer), and as many layers as bring the total nearest N. Every number assumed is listed
in the plan's output; ``--model DIR`` replaces them all with the real module tree.
"""

from __future__ import annotations

from typing import Any

from tiered.errors import TieredError

VOCAB = 32_000


def llama_dims(total: int, largest_layer: int | None = None) -> dict[str, int]:
    """hidden, intermediate, layers, vocab of [Note: shape model for --params] for `total`."""
    h = max(256, int(round((10.7 * total) ** (1 / 3) / 256)) * 256)
    while h > 256 and 2 * VOCAB * h > total / 2:  # small models: keep the embeddings a minority
        h -= 256
    inter = max(256, int(round(8 * h / 3 / 256)) * 256)
    vocab = VOCAB if largest_layer is None else max(1, largest_layer // h)
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, round((total - 2 * vocab * h - h) / per_layer))
    return {"hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers, "vocab_size": vocab}


def shape_model(total: int, largest_layer: int | None = None) -> tuple[Any, tuple[str, ...]]:
    """The meta-device stand-in and the assumptions it makes, in words."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise TieredError(
            "tiered plan --params builds a stand-in Llama on the meta device and needs transformers; "
            "install it with pip install 'tiered[hf]'"
        ) from exc
    d = llama_dims(total, largest_layer)
    heads = max(1, d["hidden_size"] // 128)
    config = LlamaConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        vocab_size=d["vocab_size"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    got = sum(p.numel() for p in model.parameters())
    said = (
        f"--params stand-in ([Note: shape model for --params]): a dense Llama, hidden {d['hidden_size']}, "
        f"{d['num_hidden_layers']} layers, intermediate {d['intermediate_size']}, vocabulary {d['vocab_size']:,} "
        f"untied: {got:,} parameters; pass --model for the real module tree",
    )
    return model, said
