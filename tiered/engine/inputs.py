"""`fp16.auto_cast`: cast the floating-point inputs of the model's forward to fp16, as DeepSpeed's
engine does (`_cast_inputs_half`: tensors, and tensors inside lists, tuples and dicts; integer
tensors such as token ids are left alone)."""

from __future__ import annotations

from typing import Any

import torch


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value
