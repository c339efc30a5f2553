"""Loading compressed Adam moments (bf16 or int8) into an fp32 run: decoded on the way, exactly.

A checkpoint of a compressed run ([Note: compressed optimizer state] in
tiered/optim/state_format.py) holds each group's moments as its tiles' encodings, one after the
other. An fp32 run loads them as it loads fp32 ones ([Note: checkpoint layout]): each of its tiles
is filled chunk by chunk through the chunk pipeline, from the same per-element copies, on any
world size or tiling; only the bytes of a copy are not read as they are but decoded. A chunk's
element range is cut at the saved tiles' boundaries (a block code's scales belong to its tile, the
manifest's ``tile_bytes`` say where each begins), widened to whole blocks, and just those blocks'
bytes are read and decoded by the saved format's own codec, so memory stays a chunk whatever the
model, and the values are bit for bit the ones the compressed run would have decoded for its step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tiered.checkpoint.pipeline import Fill, pread_exact
from tiered.checkpoint.stream import dtype_code
from tiered.errors import CheckpointCorruptError

MOMENTS = ("exp_avg", "exp_avg_sq")

Copy = tuple[int, int, int, str, int]
"""(destination element, source element in the saved shard, count, saved tensor, saved rank)."""


class MomentDecoder(Protocol):
    """What a load needs of a codec (tiered/optim/state_codecs.py `MomentCodec`)."""

    name: str
    block_numel: int

    def storage(self, numel: int) -> tuple[int, torch.dtype]: ...
    def decoded_numel(self, nbytes: int) -> int: ...
    def piece_bytes(self, numel: int, start: int, stop: int) -> list[tuple[int, int]]: ...
    def decode(self, buf: torch.Tensor, out: torch.Tensor) -> None: ...


# [Note: moment codecs registered from above]
# A checkpoint names its moments' format (``optimizer_state_format``); the codecs of those formats
# live in tiered.optim.state_format, a sibling layer this one may not import. The engine layer,
# which imports both (and which `import tiered` always imports first), registers every format's
# codecs here (tiered/engine/persistence.py), so reading a checkpoint without an engine
# (tiered/checkpoint/consolidate.py) decodes compressed moments with the optimizer's own codecs.
_FORMATS: dict[str, dict[str, MomentDecoder]] = {}


def register_moment_format(name: str, codecs: Mapping[str, MomentDecoder]) -> None:
    """Make format `name`'s codec of each moment ("exp_avg", "exp_avg_sq") known to checkpoint
    reads ([Note: moment codecs registered from above])."""
    _FORMATS[name] = {k: codecs[k] for k in MOMENTS}


def moment_decoder(fmt: str, kind: str, path: str) -> MomentDecoder:
    """The codec that decodes moment `kind` of format `fmt` (a checkpoint's), or a ValueError
    naming the checkpoint, the moment and the format no codec is registered for."""
    got = _FORMATS.get(fmt, {}).get(kind)
    if got is None:
        raise ValueError(
            f"checkpoint {path} holds {kind} in optimizer-state format {fmt!r}, which this installation "
            f"cannot decode (known: {', '.join(sorted(_FORMATS)) or 'none registered'})"
        )
    return got


@dataclass(frozen=True)
class SavedMoment:
    """One saved group's encoded moment in a checkpoint file: where its bytes are and its tiles
    (start element in the shard, element count, start byte in the tensor)."""

    fd: int
    start: int
    tiles: list[tuple[int, int, int]]
    codec: MomentDecoder
    what: str

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Decode the shard's elements [lo, hi) into fp32 `out` (hi - lo elements)."""
        starts = [t[0] for t in self.tiles]
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        block = self.codec.block_numel
        while lo < hi:
            if i >= len(self.tiles):
                raise CheckpointCorruptError(f"{self.what}: element {lo} lies past its tiles")
            t0, numel, byte0 = self.tiles[i]
            end = min(hi, t0 + numel)
            if end > lo:
                a = (lo - t0) // block * block  # whole blocks: a block decodes only with its scale
                b = min(numel, math.ceil((end - t0) / block) * block)
                ranges = self.codec.piece_bytes(numel, a, b)
                buf = torch.empty(sum(n for _, n in ranges), dtype=torch.uint8)
                at = 0
                for off, n in ranges:
                    pread_exact(self.fd, buf[at:], self.start + byte0 + off, n, direct=False, what=self.what)
                    at += n
                dec = torch.empty(b - a)
                self.codec.decode(buf, dec)
                out[: end - lo].copy_(dec[lo - t0 - a : end - t0 - a])
                out = out[end - lo :]
                lo = end
            i += 1


def saved_moment(
    codec: MomentDecoder,
    layout: dict[str, Any],
    stored: Any,
    fd: int,
    path: str,
    name: str,
) -> SavedMoment:
    """The encoded moment `name` of one saved group (its manifest `layout`, the file's header
    entry `stored`), checked: its dtype is the codec's, its tiles add up to its bytes."""
    what = f"checkpoint {path}, tensor {name}"
    if stored is None:
        raise CheckpointCorruptError(f"{what}: not in its rank's file (the manifest names it)")
    want = dtype_code(codec.storage(1)[1])
    if stored.dtype != want:
        raise CheckpointCorruptError(f"{what} is {stored.dtype}, expected {want} (the {codec.name} code)")
    nbytes = stored.end - stored.start
    tile_bytes = layout.get("tile_bytes") or [nbytes]
    if codec.block_numel == 1:
        tile_bytes = [nbytes]  # coded element by element: the tiles need not be known
    tiles, elem, byte = [], 0, 0
    try:
        for tb in tile_bytes:
            n = codec.decoded_numel(int(tb))
            tiles.append((elem, n, byte))
            elem, byte = elem + n, byte + int(tb)
    except ValueError as e:
        raise CheckpointCorruptError(f"{what}: {e}") from None
    if byte != nbytes or elem != int(layout["shard_numel"]):
        raise CheckpointCorruptError(
            f"{what}: its tiles ({tile_bytes} bytes) hold {elem} elements in {byte} bytes, the file "
            f"{nbytes} bytes and the manifest {layout['shard_numel']} elements"
        )
    return SavedMoment(fd, stored.start, tiles, codec, what)


def decoding_filler(copies: Sequence[Copy], sources: dict[tuple[int, str], SavedMoment]) -> Fill:
    """fill(buf, off, n) for an fp32 tile: the decoded values of `copies`, zero between them
    (padding), as `partition_io`'s filler does for plain bytes. Thread-safe (the pipeline's I/O
    threads call it): every call decodes into its own buffers."""
    segs = sorted(copies)
    starts = [c[0] for c in segs]

    def fill(buf: torch.Tensor, off: int, n: int) -> None:
        out = buf[:n].view(torch.float32)
        out.zero_()
        e0, e1 = off // 4, (off + n) // 4
        i = max(0, bisect.bisect_right(starts, e0) - 1)
        while i < len(segs) and segs[i][0] < e1:
            dst, src, count, name, rank = segs[i]
            lo, hi = max(e0, dst), min(e1, dst + count)
            if hi > lo:
                sources[(rank, name)].read(src + lo - dst, src + hi - dst, out[lo - e0 : hi - e0])
            i += 1

    return fill
