"""Argument checks shared by the native kernels and the reference.

Bad input is a ValueError naming the argument and the fix, never a segfault or an out-of-bounds
write. The reference runs these checks first; the native path lets the C++ binding check first and
runs them to word the error (see [Note: two-layer argument checks] in tiered_ext/__init__.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, TypedDict

import torch
from typing_extensions import NotRequired

_LOWP = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, *_LOWP)
_STATE_DTYPES = (torch.float32, torch.bfloat16)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class AdamScalars(TypedDict):
    """The Adam/AdamW hyper-parameters every kernel entry takes by keyword (`step` aside: one
    count, or one per tensor). The entries declare ``**hyper: Unpack[AdamScalars]`` instead of
    repeating the keywords, and `bind_scalars` checks them once."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: NotRequired[bool]
    grad_scale: NotRequired[float]


class BoundScalars(NamedTuple):
    """`AdamScalars` validated, defaults filled, in the native bindings' argument order."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    grad_scale: float


def _bound(
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    grad_scale: float = 1.0,
) -> BoundScalars:
    # a real signature: a missing or unknown keyword is Python's own TypeError naming it
    return BoundScalars(
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw_mode),
        float(grad_scale),
    )


def bind_scalars(step: int, hyper: Mapping[str, Any]) -> BoundScalars:
    """The keywords an entry received, checked (`check_scalars`, with `step`) and bound."""
    bound = _bound(**hyper)
    check_scalars(
        step=step,
        lr=bound.lr,
        beta1=bound.beta1,
        beta2=bound.beta2,
        eps=bound.eps,
        weight_decay=bound.weight_decay,
        grad_scale=bound.grad_scale,
    )
    return bound


def check_scalars(
    *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float
) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(
            f"step must be an int >= 1 (the 1-based step count for bias correction), got {step!r}"
        )
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not (0.0 <= beta < 1.0):
            raise ValueError(f"{name} must be in [0, 1), got {beta!r}")
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale must be finite, got {grad_scale!r}")


def check_tensors(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out_lowp: torch.Tensor | None,
    *,
    device_type: str | None = "cpu",
    where: str = "",
) -> None:
    """Checks one partition's buffers; ``device_type=None`` accepts any device (all the same)."""
    named = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out_lowp is not None:
        named.append(("out_lowp", out_lowp))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}{where} must be a torch.Tensor, got {type(t).__name__}")
    n = param.numel()
    dev = param.device
    for name, t in named:
        if device_type is not None and t.device.type != device_type:
            raise ValueError(
                f"{name}{where} is on {t.device}, expected a {device_type} tensor: move it with .to('{device_type}')"
            )
        if t.device != dev:
            raise ValueError(
                f"{name}{where} is on {t.device} but param is on {dev}: all buffers must share a device"
            )
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{name}{where} must be a 1-D contiguous tensor (got shape {tuple(t.shape)}, "
                f"contiguous={t.is_contiguous()}): pass t.view(-1) of a contiguous buffer"
            )
        if t.numel() != n:
            raise ValueError(f"{name}{where} has {t.numel()} elements but param has {n}: sizes must match")
    if param.dtype != torch.float32:
        raise ValueError(f"param{where} must be float32 (the master copy), got {param.dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad{where} must be float32, bfloat16 or float16, got {grad.dtype}")
    if exp_avg.dtype not in _STATE_DTYPES:
        raise ValueError(f"exp_avg{where} must be float32 or bfloat16, got {exp_avg.dtype}")
    if exp_avg_sq.dtype != exp_avg.dtype:
        raise ValueError(
            f"exp_avg_sq{where} is {exp_avg_sq.dtype} but exp_avg is {exp_avg.dtype}: both must match"
        )
    if out_lowp is not None and out_lowp.dtype not in _LOWP:
        raise ValueError(f"out_lowp{where} must be bfloat16 or float16, got {out_lowp.dtype}")
    if n == 0:
        return
    spans = [(name, _span(t)) for name, t in named]
    for i, (a, (a0, a1)) in enumerate(spans):
        for b, (b0, b1) in spans[i + 1 :]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{a}{where} and {b}{where} share memory: each buffer must be distinct")
