"""tiered "aiofiles" backend: plain buffered async files (the simple baseline)."""

from __future__ import annotations

from tiered_aiofiles.backend import AiofilesBackend

__all__ = ["AiofilesBackend"]
