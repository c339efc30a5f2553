"""tiered "cpu" backend: pinned (page-locked) host memory from a reusable buffer pool."""

from __future__ import annotations

from tiered_cpu.backend import PinnedCPUBackend

__all__ = ["PinnedCPUBackend"]
