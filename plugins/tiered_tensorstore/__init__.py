"""tiered "tensorstore" backend: any TensorStore kvstore (file, memory, gcs, s3, ...)."""

from __future__ import annotations

from tiered_tensorstore.backend import TensorStoreBackend

__all__ = ["TensorStoreBackend"]
