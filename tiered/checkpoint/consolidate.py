"""Whole parameters out of a checkpoint, without an engine (DeepSpeed's zero_to_fp32, for any
world size): each parameter is assembled from its pieces (see [Note: checkpoint layout])."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch

from tiered.checkpoint import directory as d
from tiered.checkpoint.decode_load import MOMENTS, MomentDecoder, SavedMoment, moment_decoder, saved_moment
from tiered.checkpoint.manifest_layout import check_engine_layout
from tiered.checkpoint.stream import StoredTensor, tensor_ranges, verify_file

KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


def iter_parameters(
    load_dir: str | os.PathLike[str], tag: str | None = None, *, kind: str = "master"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter, one at a time. `kind`: "param" (compute dtype), "master"
    (fp32; the parameter itself where the run kept no separate master), "exp_avg", "exp_avg_sq".
    Frozen parameters have only "param" ("master" falls back to it, in its own dtype). Moments
    come in fp32: those of a compressed-state run (bf16, int8) decoded by the format's own codec,
    the values the optimizer steps on ([Note: compressed moments read decoded])."""
    from safetensors import safe_open

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = d.resolve(os.fspath(load_dir), tag)
    m = d.read_manifest(path)
    check_engine_layout(os.path.join(path, d.MANIFEST), m)  # [Note: manifest layout checked on read]
    fmt = m.get("optimizer_state_format", "fp32")  # older checkpoints hold fp32 moments
    codec = moment_decoder(fmt, kind, path) if kind in MOMENTS and fmt != "fp32" else None
    for fname, rec in m["files"].items():
        verify_file(os.path.join(path, fname), rec)
    tensors = {(lay["rank"], g["name"]): g["tensors"] for lay in m["ranks"] for g in lay["groups"]}
    files = {lay["rank"]: os.path.join(path, lay["file"]) for lay in m["ranks"]}
    with ExitStack() as stack:
        if codec is not None:
            read = _decoding_reader(m, path, files, codec, stack)
        else:
            handles = {r: safe_open(f, "pt") for r, f in files.items()}

            def read(rank: int, group: str, src: str, start: int, length: int) -> torch.Tensor:
                piece: torch.Tensor = handles[rank].get_slice(src)[start : start + length]
                return piece

        for name, info in m["parameters"].items():
            out: torch.Tensor | None = None
            for p in info["pieces"]:
                rank, group = int(p["rank"]), p["group"]
                names = tensors[(rank, group)]
                src = names.get(kind, names["param"] if kind == "master" else None)
                if src is None:
                    raise KeyError(f"parameter {name} is frozen: the checkpoint holds no {kind} for it")
                piece = read(rank, group, src, int(p["start_in_shard"]), int(p["length"]))
                if out is None:
                    out = torch.empty(torch.Size(info["shape"]).numel(), dtype=piece.dtype)
                out[int(p["start_in_param"]) : int(p["start_in_param"]) + int(p["length"])] = piece
            assert out is not None
            yield name, out.view(info["shape"])


# [Note: compressed moments read decoded]
# A compressed-state checkpoint ([Note: compressed optimizer state] in tiered/optim/state_format.py)
# holds each group's moments as its tiles' encodings: int8 block codes whose scales belong to a
# tile, bf16 values. A parameter's piece is read as an fp32 run's load reads it
# (tiered/checkpoint/decode_load.py): the bytes of the whole blocks it touches within the saved
# tiles the manifest's ``tile_bytes`` locate, decoded by the saved format's codec, so every value
# is bit for bit the one the compressed run decodes for its step, on any tiling or world size,
# and memory stays one parameter plus the blocks of one of its pieces.
def _decoding_reader(
    m: dict[str, Any],
    path: str,
    files: dict[int, str],
    codec: MomentDecoder,
    stack: ExitStack,
) -> Callable[[int, str, str, int, int], torch.Tensor]:
    """read(rank, group, tensor, start, length): that piece of a saved group's moment, decoded
    by `codec` to fp32 ([Note: compressed moments read decoded])."""
    layouts = {(lay["rank"], g["name"]): g for lay in m["ranks"] for g in lay["groups"]}
    fds: dict[int, int] = {}
    ranges: dict[int, dict[str, StoredTensor]] = {}
    moments: dict[tuple[int, str], SavedMoment] = {}

    def read(rank: int, group: str, src: str, start: int, length: int) -> torch.Tensor:
        sm = moments.get((rank, group))
        if sm is None:
            if rank not in fds:
                fds[rank] = os.open(files[rank], os.O_RDONLY)
                stack.callback(os.close, fds[rank])
                ranges[rank] = tensor_ranges(files[rank])
            sm = saved_moment(codec, layouts[(rank, group)], ranges[rank].get(src), fds[rank], path, src)
            moments[(rank, group)] = sm
        out = torch.empty(length)
        sm.read(start, start + length, out)
        return out

    return read


def read_parameters(
    load_dir: str | os.PathLike[str], tag: str | None = None, *, kind: str = "master"
) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint, whole (see `iter_parameters`)."""
    return dict(iter_parameters(load_dir, tag, kind=kind))
