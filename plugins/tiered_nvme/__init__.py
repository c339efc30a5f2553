"""tiered "nvme" backend: one file per key, O_DIRECT through a bounded thread pool."""

from __future__ import annotations

from tiered_nvme.backend import ALIGN, NVMeBackend

__all__ = ["ALIGN", "NVMeBackend"]
