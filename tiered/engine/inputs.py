"""`fp16.auto_cast`: cast the floating-point inputs of the model's forward to fp16, as DeepSpeed's
engine does (`_cast_inputs_half`: tensors, and tensors inside lists, tuples and dicts; integer
tensors such as token ids are left alone); and the clear error for inputs in the wrong dtype."""

from __future__ import annotations

from typing import Any

import torch

from tiered.errors import InputDtypeError


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def _floating(value: Any, where: str) -> list[tuple[str, torch.dtype]]:
    if isinstance(value, torch.Tensor):
        return [(where, value.dtype)] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [f for i, v in enumerate(value) for f in _floating(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        return [f for k, v in value.items() for f in _floating(v, f"{where}[{k!r}]")]
    return []


def input_dtype_error(
    exc: RuntimeError, module: torch.nn.Module, compute_dtype: torch.dtype, args: Any, kwargs: Any
) -> InputDtypeError | None:
    """The error to raise over `exc` (a dtype clash inside forward) when floating inputs are not
    in the 16-bit compute dtype; None when that is not what happened."""
    if compute_dtype not in (torch.float16, torch.bfloat16) or "type" not in str(exc):
        return None  # ("dtype", "scalar type", "Input type ... weight type": torch's wordings)
    found = _floating(tuple(args), "argument") + [f for k, v in kwargs.items() for f in _floating(v, k)]
    wrong = [(n, d) for n, d in found if d != compute_dtype]
    if not wrong:
        return None
    name, dtype = wrong[0]
    target = "torch.float16" if compute_dtype == torch.float16 else "torch.bfloat16"
    fix = f"cast it with .to({target}) before the forward"
    if compute_dtype == torch.float16:
        fix += ', or set "fp16": {"auto_cast": true} to have the engine cast floating inputs'
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return InputDtypeError(
        f"{type(module).__name__}.forward: input {name!r}{more} is {dtype}, but the model runs in "
        f"{compute_dtype} ({'fp16' if compute_dtype == torch.float16 else 'bf16'} enabled): {fix} "
        f"(torch said: {exc})"
    )
