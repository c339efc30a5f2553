"""``deepspeed.runtime.compiler``: the torch.compile helpers DeepSpeed scripts call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["disable", "is_compile_supported", "is_compiling"]


def is_compile_supported() -> bool:
    """torch.compile exists (torch >= 2.1, which tiered requires anyway)."""
    return hasattr(torch, "compile")


def is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def disable(func: F) -> F:
    """Keep `func` out of torch.compile's graphs, as DeepSpeed's decorator does."""
    out: F = torch.compiler.disable(func)
    return out
