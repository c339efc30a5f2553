"""The fused Adam step in plain torch: the fallback when the native build fails, and the oracle
of the kernel tests.

It repeats torch.optim.AdamW's single-tensor algorithm operation by operation (lerp_ for the
first moment, mul_/addcmul_ for the second, addcdiv_ for the update, Python-float scalars), so it
matches torch.optim.AdamW / Adam to the last bit or so; the native kernels agree with it to a few
ulps (their own op order is described in csrc/cpu_adam/scalar_ops.h).
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from ._validate import AdamScalars, bind_scalars, check_tensors


@torch.no_grad()
def adam_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    out_lowp: torch.Tensor | None = None,
    check_finite: bool = False,
    **hyper: Unpack[AdamScalars],
) -> bool:
    """One Adam/AdamW step on a flat partition; see tiered_ext.adam_step for the contract."""
    check_tensors(param, grad, exp_avg, exp_avg_sq, out_lowp, device_type=None)
    lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale = bind_scalars(step, hyper)
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if check_finite and not bool(torch.isfinite(g).all()):
        return True
    if weight_decay != 0.0:
        if adamw_mode:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    lowp_states = exp_avg.dtype != torch.float32
    m = exp_avg.float() if lowp_states else exp_avg
    v = exp_avg_sq.float() if lowp_states else exp_avg_sq
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(m, denom, value=-step_size)
    if lowp_states:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if out_lowp is not None:
        out_lowp.copy_(param)
    return False
