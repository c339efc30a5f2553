"""Writing a Hugging Face model folder with random weights, shard by shard (for tests and the
scaled replica): the model is never on the host, only one shard's tensors at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tiered.zero.conversions import export_layout
from tiered.zero.load import INDEX_NAME


def write_random_weights(
    folder: str | Path,
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 1 << 30,
    seed: int = 0,
    std: float = 0.02,
) -> list[Path]:
    """config.json, ``model-0000i-of-0000n.safetensors`` shards and the index for `hf_config`'s
    causal LM: weights N(0, std), norms one; tied weights written once; under the names and in
    the layout transformers' ``save_pretrained`` writes (one tensor per expert where the family's
    files have them: [Note: file tensors by transformers' conversions]), one tensor at a time.
    Returns the shard paths."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.to_json_file(str(out / "config.json"))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    params = list(dict(meta.named_parameters()).items())  # tied: the first name only
    layout = export_layout(meta, [(n, tuple(p.shape)) for n, p in params]) or {}
    names = [(k, torch.Size(s)) for n, p in params for k, s, _ in layout.get(n, [(n, tuple(p.shape), [])])]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    for name, shape in names:
        nbytes = shape.numel() * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    paths = []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if len(shape) == 1:  # norms and biases: ones / zeros, as HF initialises them
                t = torch.ones(shape, dtype=dtype) if "norm" in name else torch.zeros(shape, dtype=dtype)
            else:
                t = (torch.randn(shape, generator=gen) * std).to(dtype)
            tensors[name] = t
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
        paths.append(out / fname)
    total = sum(shape.numel() * itemsize for _, shape in names)
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1), encoding="utf-8"
    )
    return paths
