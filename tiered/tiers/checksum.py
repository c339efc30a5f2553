"""Checksums of the bytes written to persistent tiers, and their check on the way back.

A persistent tier's copy carries the crc32 of the bytes last written there
(`Partition.checksum`); a read from it with ``verify=True`` recomputes it over the buffer it
filled (`Transfers.read_into` is the one place a tier's bytes come back into memory).
"""

from __future__ import annotations

import zlib

import torch

from tiered.errors import StorageIOError
from tiered.tiers.error_context import mark


def crc32_of(t: torch.Tensor) -> int:
    b = t.detach().reshape(-1).view(torch.uint8)
    if b.device.type != "cpu":
        b = b.cpu()
    return zlib.crc32(b.numpy().data)


def check_crc(got: int, want: int, context: str, dst: str) -> None:
    """StorageIOError naming the copy when the bytes read are not the bytes written."""
    if got != want:
        raise mark(
            StorageIOError(
                f"{context}: checksum mismatch reading into tier {dst!r} "
                f"(crc32 {got:#010x}, expected {want:#010x}); the stored copy is corrupt - "
                "restore it from a checkpoint"
            )
        )
