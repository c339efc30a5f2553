"""`save_pretrained`: the model's weights consolidated into a Hugging Face directory, streamed.

[Note: streamed export]
The export writes the layout ``from_pretrained`` reads: config.json (and generation_config.json)
when the model has a Hugging Face config, ``model.safetensors`` or, beyond `max_shard_size`,
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``. Every name,
shape and dtype is known from the shard groups before a byte is read, so each shard's header is
written first (see [Note: streamed safetensors]) and the groups are then gathered one at a time
(every rank takes part in the gather; rank 0 writes), each parameter cast to `dtype` and
appended: memory grows by one group, never the model. Each file is written under a temporary
name and renamed into place, so an interrupted export never leaves a partial file where a good
one was; shards of an earlier export that the new one does not name are removed, as
transformers does, so a loader cannot mix two exports.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from tiered.checkpoint import directory as d
from tiered.checkpoint.stream import StreamWriter, TensorSpec
from tiered.units import parse_bytes

log = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
INDEX = "model.safetensors.index.json"


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for mname, m in model.named_modules():
        for bname, buf in m._buffers.items():
            if buf is not None and bname not in m._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, buf))
    return out


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive specs into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )


def save_pretrained(
    model: torch.nn.Module,
    full_groups: Iterator[tuple[Any, list[tuple[str, torch.Tensor]]]],
    groups: list[Any],
    save_directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    max_shard_size: int | str,
    writer: bool,
) -> str:
    """Write the Hugging Face layout of [Note: streamed export]. `full_groups` gathers the
    groups one by one (every rank iterates it); only the `writer` rank touches the disk."""
    out_dir = os.fspath(save_directory)
    max_bytes = parse_bytes(max_shard_size, what="save_pretrained(max_shard_size=...)")
    buffers = _persistent_buffers(model)
    specs = [TensorSpec(e.name, dtype, e.shape) for g in groups for e in g.entries]
    specs += [TensorSpec(n, dtype if b.is_floating_point() else b.dtype, tuple(b.shape)) for n, b in buffers]
    shards = plan_shards(specs, max_bytes)
    names = shard_names(len(shards))
    shard_of = {s.name: i for i, shard in enumerate(shards) for s in shard}
    file_of = {name: names[i] for name, i in shard_of.items()}
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        d.check_free_space(out_dir, sum(s.nbytes for s in specs))
        _write_config(model, out_dir)
    current: list[Any] = [None, -1]  # open StreamWriter, shard index

    def put(name: str, t: torch.Tensor) -> None:
        if not writer:
            return
        i = shard_of[name]
        if current[1] != i:
            _finish(current[0], out_dir)
            current[0] = StreamWriter(
                os.path.join(out_dir, f".{names[i]}.partial"), shards[i], {"format": "pt"}
            )
            current[1] = i
        current[0].append(t.detach().to(dtype if t.is_floating_point() else t.dtype).to("cpu").contiguous())

    try:
        for _g, params in full_groups:
            for name, t in params:
                put(name, t)
        for name, b in buffers:
            put(name, b)
        _finish(current[0], out_dir)
        current[0] = None
    except BaseException:
        if current[0] is not None:
            current[0].close()
            os.remove(current[0].path)
        raise
    if writer:
        if len(names) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": file_of}
            tmp = os.path.join(out_dir, f".{INDEX}.partial")
            d.write_json_durably(tmp, index)
            os.replace(tmp, os.path.join(out_dir, INDEX))
        elif os.path.exists(os.path.join(out_dir, INDEX)):
            os.remove(os.path.join(out_dir, INDEX))
        for f in os.listdir(out_dir):  # shards of an earlier export: see [Note: streamed export]
            if _SHARD_RE.match(f) and f not in names:
                os.remove(os.path.join(out_dir, f))
        d.fsync_dir(out_dir)
        log.info("exported %d parameters in %d shard(s) to %s", len(specs), len(names), out_dir)
    return out_dir


def _finish(w: StreamWriter | None, out_dir: str) -> None:
    if w is None:
        return
    w.finish()
    final = os.path.join(out_dir, os.path.basename(w.path)[1 : -len(".partial")])
    os.replace(w.path, final)


def _write_config(model: torch.nn.Module, out_dir: str) -> None:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            gen.save_pretrained(out_dir)
        except (ValueError, TypeError) as e:  # an invalid generation config must not lose the weights
            log.warning("generation_config.json not written: %s", e)
    elif cfg is None:
        log.info("the model has no Hugging Face config: %s holds the weights only", out_dir)
