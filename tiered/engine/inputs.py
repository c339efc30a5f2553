"""`fp16.auto_cast`: cast the floating-point inputs of the model's forward to fp16, as DeepSpeed's
engine does (`_cast_inputs_half`: tensors, and tensors inside lists, tuples and dicts; integer
tensors such as token ids are left alone); the clear error for inputs in the wrong dtype; and
the inputs refused before the forward runs (an empty batch, a tensor on the meta device), and a
loss `backward` cannot take."""

from __future__ import annotations

from typing import Any

import torch

from tiered.errors import InputDtypeError, InputError


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def _tensors(value: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(where, value)]
    if isinstance(value, (list, tuple)):
        return [f for i, v in enumerate(value) for f in _tensors(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        return [f for k, v in value.items() for f in _tensors(v, f"{where}[{k!r}]")]
    return []


def _named_inputs(args: Any, kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    return _tensors(tuple(args), "argument") + [f for k, v in kwargs.items() for f in _tensors(v, k)]


def check_inputs(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
    """Refuse, before the forward, inputs no step can learn from: a tensor on the meta device (it
    holds no data), and an empty batch (every top-level tensor input has 0 rows: its loss is
    0/0 = NaN). A size-0 dimension elsewhere (an empty KV cache) is fine."""
    name = type(module).__name__
    found = _named_inputs(args, kwargs)
    meta = [n for n, t in found if t.is_meta]
    if meta:
        raise InputError(
            f"{name}.forward: input {meta[0]!r} is on the meta device (a shape without data); "
            "pass real tensors (create them on the cpu or the training device)"
        )
    top = [(f"argument[{i}]", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    top += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    batched = [(n, t) for n, t in top if t.dim() > 0]
    if batched and all(t.shape[0] == 0 for _, t in batched):
        n, t = batched[0]
        raise InputError(
            f"{name}.forward: the batch is empty (input {n!r} has shape {tuple(t.shape)}): its loss "
            "would be NaN; skip empty batches in the data loader (drop_last=True, or filter them)"
        )


def input_dtype_error(
    exc: RuntimeError, module: torch.nn.Module, compute_dtype: torch.dtype, args: Any, kwargs: Any
) -> InputDtypeError | None:
    """The error to raise over `exc` (a dtype clash inside forward) when inputs are not in the
    compute dtype: floating ones of another dtype (fp32 into a 16-bit model, float64 into an
    fp32 one), else integer ones where the model wanted floating point; None when that is not
    what happened."""
    if "type" not in str(exc):
        return None  # ("dtype", "scalar type", "Input type ... weight type": torch's wordings)
    found = _named_inputs(args, kwargs)
    target = str(compute_dtype)
    wrong = [(n, t.dtype) for n, t in found if t.is_floating_point() and t.dtype != compute_dtype]
    if wrong:
        fix = f"cast it with .to({target}) before the forward"
    else:
        ints = ("Long", "Int", "Short", "Byte", "Char", "Bool")
        if not any(w in str(exc) for w in ints):
            return None
        wrong = [(n, t.dtype) for n, t in found if not t.is_floating_point() and not t.is_complex()]
        if not wrong:
            return None
        fix = (
            f"a layer got integers where it computes in floating point: cast it with .to({target}) "
            "(token ids belong in an embedding layer)"
        )
    if compute_dtype == torch.float16:
        fix += ', or set "fp16": {"auto_cast": true} to have the engine cast floating inputs'
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    enabled = {torch.float16: " (fp16 enabled)", torch.bfloat16: " (bf16 enabled)"}.get(compute_dtype, "")
    name, dtype = wrong[0]
    return InputDtypeError(
        f"{type(module).__name__}.forward: input {name!r}{more} is {dtype}, but the model runs in "
        f"{compute_dtype}{enabled}: {fix} (torch said: {exc})"
    )


def check_loss(loss: Any) -> None:
    """What `Engine.backward` takes: a scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            "engine.backward(loss): loss must be a scalar tensor (e.g. out.loss or out.mean()), "
            f"got {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
        )
    if not loss.requires_grad:
        raise ValueError("engine.backward(loss): loss does not require grad; was it computed by engine(...)?")
