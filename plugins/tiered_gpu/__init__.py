"""tiered "gpu" backend: resident tensors in the compute device's memory."""

from __future__ import annotations

from tiered_gpu.backend import GPUBackend

__all__ = ["GPUBackend"]
