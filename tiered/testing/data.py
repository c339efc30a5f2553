"""Reproducible test bytes for the conformance suite."""

from __future__ import annotations

import math

import torch


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` reproducible random bytes (fast: generated as int64 words)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(
        -(2**63), 2**63 - 1, (max(1, math.ceil(nbytes / 8)),), dtype=torch.int64, generator=g
    )
    return words.view(torch.uint8)[:nbytes].clone()
