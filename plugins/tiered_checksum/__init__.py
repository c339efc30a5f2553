"""tiered "checksum" backend: wraps any backend spec and keeps an xxh3 digest beside every object,
verified on every read, so corruption of a persistent store is caught across processes."""

from __future__ import annotations

from tiered_checksum.backend import ChecksumBackend

__all__ = ["ChecksumBackend"]
