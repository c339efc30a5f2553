"""Whole parameters out of a checkpoint, without an engine (DeepSpeed's zero_to_fp32, for any
world size): each parameter is assembled from its pieces (see [Note: checkpoint layout])."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from tiered.checkpoint import directory as d
from tiered.checkpoint.stream import verify_file

KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


def iter_parameters(
    load_dir: str | os.PathLike[str], tag: str | None = None, *, kind: str = "master"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter, one at a time. `kind`: "param" (compute dtype), "master"
    (fp32; the parameter itself where the run kept no separate master), "exp_avg", "exp_avg_sq".
    Frozen parameters have only "param" ("master" falls back to it, in its own dtype). Moments of
    a bf16-state run come in bfloat16; those of an int8 one are refused (block codes per tile)."""
    from safetensors import safe_open

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = d.resolve(os.fspath(load_dir), tag)
    m = d.read_manifest(path)
    if kind in ("exp_avg", "exp_avg_sq") and m.get("optimizer_state_format") == "int8":
        raise ValueError(
            f"checkpoint {path} holds {kind} as int8 block codes (tiered.optimizer_state_format "
            "'int8'), per tile, not per element: read it through an engine of the same format"
        )
    for fname, rec in m["files"].items():
        verify_file(os.path.join(path, fname), rec)
    tensors = {(lay["rank"], g["name"]): g["tensors"] for lay in m["ranks"] for g in lay["groups"]}
    files = {lay["rank"]: os.path.join(path, lay["file"]) for lay in m["ranks"]}
    handles = {r: safe_open(f, "pt") for r, f in files.items()}
    for name, info in m["parameters"].items():
        pieces = info["pieces"]
        out: torch.Tensor | None = None
        for p in pieces:
            names = tensors[(int(p["rank"]), p["group"])]
            src = names.get(kind, names["param"] if kind == "master" else None)
            if src is None:
                raise KeyError(f"parameter {name} is frozen: the checkpoint holds no {kind} for it")
            s = int(p["start_in_shard"])
            piece = handles[int(p["rank"])].get_slice(src)[s : s + int(p["length"])]
            if out is None:
                numel = 1
                for x in info["shape"]:
                    numel *= int(x)
                out = torch.empty(numel, dtype=piece.dtype)
            out[int(p["start_in_param"]) : int(p["start_in_param"]) + int(p["length"])] = piece
        assert out is not None
        yield name, out.view(info["shape"])


def read_parameters(
    load_dir: str | os.PathLike[str], tag: str | None = None, *, kind: str = "master"
) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint, whole (see `iter_parameters`)."""
    return dict(iter_parameters(load_dir, tag, kind=kind))
