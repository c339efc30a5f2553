"""Test helpers shipped with tiered: the storage backend conformance suite.

Requires pytest (the ``test`` extra). See `tiered.testing.conformance` for the example.
"""

from __future__ import annotations

from tiered.testing.conformance import (
    ALL_DTYPES,
    INVALID_KEYS,
    UNALIGNED_SIZES,
    BackendConformance,
    as_bytes,
    random_bytes,
    random_tensor,
    unaligned_empty,
)

__all__ = [
    "ALL_DTYPES",
    "INVALID_KEYS",
    "UNALIGNED_SIZES",
    "BackendConformance",
    "as_bytes",
    "random_bytes",
    "random_tensor",
    "unaligned_empty",
]
