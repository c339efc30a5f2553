"""Small helpers shared by the tier modules: error context, checksums, byte formatting.

[Note: error context]
An error raised on the loop (a backend failing mid-read, a timeout) is re-raised in the training
thread by `TierFuture.result`. On the way, the first tier-layer frame that sees it prefixes what
was going on - operation, partition, tiers of the move, backend names, key - and marks it, so
outer frames do not prefix it again. The error keeps its type (a StorageKeyError stays a
KeyError, a backend's ValueError stays a ValueError) with the original as ``__cause__``; only
an exception type that cannot be rebuilt from a message becomes a StorageIOError.
"""

from __future__ import annotations

import zlib

import torch

from tiered.errors import StorageIOError
from tiered.units import format_bytes as _format_bytes


def format_bytes(n: int) -> str:
    return _format_bytes(n, binary=True)


def crc32_of(t: torch.Tensor) -> int:
    b = t.detach().reshape(-1).view(torch.uint8)
    if b.device.type != "cpu":
        b = b.cpu()
    return zlib.crc32(memoryview(b.numpy()))


def with_context(exc: BaseException, context: str) -> BaseException:
    """`exc` with `context` (partition, tier, op, key) prefixed, keeping its type when possible."""
    if getattr(exc, "_tiers_context", False) or not isinstance(exc, Exception):
        return exc
    msg = f"{context}: {exc}"
    try:
        new = type(exc)(msg)
    except Exception:
        new = StorageIOError(msg)
    new.__cause__ = exc
    new._tiers_context = True  # type: ignore[attr-defined]
    return new


def _mark(exc: BaseException) -> BaseException:
    exc._tiers_context = True  # type: ignore[attr-defined]
    return exc
