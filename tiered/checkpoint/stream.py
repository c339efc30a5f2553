"""A safetensors file written as a stream: the header first, then each tensor's bytes in chunks.

[Note: streamed safetensors]
``safetensors.torch.save_file`` needs every tensor in memory at once: for a shard of a 40B
model's optimizer state that is the whole shard in RAM. The format does not need that: a file
is an 8-byte little-endian header length, a JSON header naming every tensor's dtype, shape and
byte range, then the bytes in that order. With every name, dtype and shape known up front the
header is written first and the bytes follow chunk by chunk from whatever buffer the caller
holds (one partition, or a bounded staging buffer), so memory stays bounded by one chunk.
The file's checksum (xxh3-64, see [Note: checkpoint checksum]) is computed over the same
chunks on their way out, so the bytes are hashed once, from memory, never re-read. Every
`WRITEBACK_BYTES` written, the writer asks the kernel to start writing them out
(``posix_fadvise(DONTNEED)`` starts writeback of a range's dirty pages without waiting, and
drops its clean ones): the disk writes while the next bytes are still being read from their
tier, instead of all at the final fsync, and a checkpoint of hundreds of GB does not fill the
page cache.

[Note: checkpoint checksum]
xxh3-64 from the ``xxhash`` library, chosen by measurement on the development machine: 16.0
GB/s for xxh3-64 against 14.2 GB/s for crc32c (the ``crc32c`` library, SSE4.2) and 3.3 GB/s
for zlib's crc32, over a 256 MiB buffer. A checksum is for detecting torn or corrupted files,
not an adversary; 64 bits make a silent collision negligible.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from tiered.checkpoint.paths import lstat_or_none, open_regular
from tiered.errors import CheckpointCorruptError, CheckpointSpaceError

CHECKSUM_ALGORITHM = "xxh3_64"
_READ_CHUNK_BYTES = 16 << 20

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

# The one call that puts bytes on disk; tests replace it to simulate a disk that fills up.
_raw_write = os.write
WRITEBACK_BYTES = 64 << 20
"""Bytes written between two writeback kicks ([Note: streamed safetensors])."""


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"safetensors has no code for dtype {dtype}") from None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a streamed file: known before any byte is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty(0, dtype=self.dtype).element_size()


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for `specs`, laid out in the order given."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for s in specs:
        if s.name in header or s.name == "__metadata__":
            raise ValueError(f"tensor name {s.name!r} appears twice in one safetensors file")
        header[s.name] = {
            "dtype": dtype_code(s.dtype),
            "shape": list(s.shape),
            "data_offsets": [off, off + s.nbytes],
        }
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(raw)) + raw


def file_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    return len(header_bytes(specs, metadata)) + sum(s.nbytes for s in specs)


def _as_bytes(chunk: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous host tensor."""
    if chunk.device.type != "cpu":
        raise ValueError(f"streamed writes take host tensors; got one on {chunk.device} (stage it first)")
    flat = chunk.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy().data.cast("B")


class StreamWriter:
    """Writes one safetensors file: `append` each tensor's bytes in spec order, then `finish`.

    See [Note: streamed safetensors]. Any OSError closes the file and propagates; ENOSPC becomes
    CheckpointSpaceError naming the file. The caller owns deleting a file it abandons.
    """

    def __init__(self, path: str, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.specs = list(specs)
        self._hash = xxhash.xxh3_64()
        self._index = 0
        self._left = self.specs[0].nbytes if self.specs else 0
        self.bytes_written = 0
        self._kicked = 0  # bytes [0, _kicked) are on their way to the disk
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._emit(memoryview(header_bytes(self.specs, metadata)))
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._left == 0 and self._index < len(self.specs):
            self._index += 1
            self._left = self.specs[self._index].nbytes if self._index < len(self.specs) else 0

    def _emit(self, mv: memoryview) -> None:
        assert self._fd is not None
        self._hash.update(mv)
        done = 0
        try:
            while done < len(mv):
                done += _raw_write(self._fd, mv[done:])
        except OSError as e:
            self.close()
            if e.errno == errno.ENOSPC:
                raise CheckpointSpaceError(
                    errno.ENOSPC,
                    f"no space left on device while writing checkpoint file {self.path} "
                    f"({self.bytes_written + done} bytes written): free space there or save elsewhere",
                    self.path,
                ) from e
            raise
        self.bytes_written += len(mv)
        if self.bytes_written - self._kicked >= WRITEBACK_BYTES:
            with contextlib.suppress(OSError):  # advice: a filesystem may ignore or refuse it
                os.posix_fadvise(
                    self._fd, self._kicked, self.bytes_written - self._kicked, os.POSIX_FADV_DONTNEED
                )
            self._kicked = self.bytes_written

    def append(self, chunk: torch.Tensor) -> None:
        """The next bytes of the current tensor (a chunk never spans two tensors)."""
        if self._fd is None:
            raise ValueError(f"{self.path}: append after finish/close")
        if self._index >= len(self.specs):
            raise ValueError(f"{self.path}: more bytes than the header declares")
        spec = self.specs[self._index]
        if chunk.dtype != spec.dtype:
            raise ValueError(
                f"{self.path}: tensor {spec.name!r} is {spec.dtype}, got a chunk of {chunk.dtype}"
            )
        mv = _as_bytes(chunk)
        if len(mv) > self._left:
            raise ValueError(
                f"{self.path}: chunk of {len(mv)} bytes overruns tensor {spec.name!r} ({self._left} bytes left)"
            )
        self._emit(mv)
        self._left -= len(mv)
        self._skip_empty()

    @property
    def current(self) -> str | None:
        """The tensor the next `append` writes to (None once every byte is in)."""
        return self.specs[self._index].name if self._index < len(self.specs) else None

    def finish(self) -> dict[str, object]:
        """fsync and close; returns the manifest's record of the file."""
        if self.current is not None:
            raise ValueError(
                f"{self.path}: tensor {self.current!r} is incomplete ({self._left} bytes missing)"
            )
        assert self._fd is not None
        os.fsync(self._fd)
        self.close()
        return {"bytes": self.bytes_written, CHECKSUM_ALGORITHM: self._hash.hexdigest()}

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def chunks_of(
    t: torch.Tensor, chunk_bytes: int, staging: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """`t` (flattened) in pieces of at most `chunk_bytes`; a device tensor is copied piece by
    piece through `staging` (a host uint8 buffer of >= chunk_bytes), host tensors are sliced."""
    flat = t.detach().reshape(-1)
    step = max(1, chunk_bytes // max(1, flat.element_size()))
    for s in range(0, flat.numel(), step):
        piece = flat[s : s + step]
        if piece.device.type == "cpu":
            yield piece
            continue
        if staging is None or staging.numel() < piece.numel() * piece.element_size():
            raise ValueError(
                f"chunks_of: a device tensor needs a host staging buffer of >= {chunk_bytes} bytes"
            )
        host = staging[: piece.numel() * piece.element_size()].view(piece.dtype)
        host.copy_(piece)
        yield host


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file: [start, end) from the file's start."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def tensor_ranges(path: str) -> dict[str, StoredTensor]:
    """Every tensor of safetensors file `path` and its byte range, from the header alone."""
    with open(open_regular(path), "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointCorruptError(f"checkpoint file {path} is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointCorruptError(
                f"checkpoint file {path}: its safetensors header is not JSON ({e})"
            ) from e
    base = 8 + n
    return {
        k: StoredTensor(
            v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1]
        )
        for k, v in header.items()
        if k != "__metadata__"
    }


def file_checksum(path: str) -> tuple[int, str]:
    """(size, xxh3-64 hex) of a file, read in bounded chunks."""
    h = xxhash.xxh3_64()
    size = 0
    with open(open_regular(path), "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK_BYTES)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            h.update(mv[:n])
            size += n
    return size, h.hexdigest()


def verify_file(path: str, record: dict[str, object]) -> None:
    """Raise CheckpointCorruptError naming `path` unless its size and checksum match `record`."""
    if lstat_or_none(path) is None:
        raise CheckpointCorruptError(f"checkpoint file {path} is missing (listed in its manifest.json)")
    size, digest = file_checksum(path)
    want = record.get(CHECKSUM_ALGORITHM)
    if size != record.get("bytes") or digest != want:
        raise CheckpointCorruptError(
            f"checkpoint file {path} fails its checksum ({CHECKSUM_ALGORITHM} {digest}, {size} bytes; "
            f"the manifest says {want}, {record.get('bytes')} bytes): the file is corrupt or was changed; "
            "load another checkpoint (tiered.checkpoint.find_latest_valid)"
        )
