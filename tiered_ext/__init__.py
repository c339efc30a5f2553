"""tiered_ext: the native kernels of tiered, with a pure-torch fallback.

    adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              adamw_mode=True, grad_scale=1.0, out_lowp=None, check_finite=False) -> bool

One fused Adam/AdamW step over a flat CPU partition: the fp32 master `param`, a fp32/bf16/fp16
`grad` (multiplied by `grad_scale` on the fly), fp32 or bf16 `exp_avg`/`exp_avg_sq`, and an
optional bf16/fp16 `out_lowp` that receives the new parameter in the same pass. `step` is the
1-based step count (torch's bias correction). Returns True iff `check_finite` and a scaled grad
element was inf/NaN, in which case nothing is modified. Semantics: torch.optim.AdamW
(adamw_mode=True) or torch.optim.Adam with L2 weight decay (adamw_mode=False).

    adam_step_reference(...)   the same in plain torch (the tests' oracle and the fallback)
    gpu_adam_step(params, grads, exp_avgs, exp_avg_sqs, *, ..., out_lowp=None) -> None
                                multi-tensor CUDA step (one launch per group); CPU lists run adam_step
    kernel_info() -> dict       which paths are active and with how many threads
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import Unpack

from . import _loader
from ._gpu import gpu_adam_step
from ._reference import adam_step_reference
from ._validate import AdamScalars, bind_scalars, check_tensors
from ._validate import check_scalars as check_scalars  # tiered.optim.kernels checks a step list's minimum

__all__ = ["AdamScalars", "adam_step", "adam_step_reference", "gpu_adam_step", "kernel_info"]


def adam_step(
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
    """Fused Adam/AdamW step on one flat CPU partition (see the module docstring); `hyper`:
    lr, beta1, beta2, eps, weight_decay, adamw_mode (True), grad_scale (1.0)."""
    bound = bind_scalars(step, hyper)
    mod = _loader.cpu_module()
    if mod is None:
        return adam_step_reference(
            param, grad, exp_avg, exp_avg_sq, step=step, out_lowp=out_lowp, check_finite=check_finite, **hyper
        )
    # [Note: two-layer argument checks]
    # The C++ binding checks every tensor (device, layout, size, dtype, overlap) before the kernel
    # touches memory and raises ValueError; only then does the Python checker run, to replace that
    # message by one naming the argument and the fix. Checking in Python first on every call would
    # cost ~15 us per partition, a tenth of a small model's optimizer step.
    try:
        return bool(
            mod.adam_step(param, grad, exp_avg, exp_avg_sq, int(step), *bound, out_lowp, bool(check_finite))
        )
    except (ValueError, TypeError):
        check_tensors(param, grad, exp_avg, exp_avg_sq, out_lowp, device_type="cpu")
        raise


def _adam_step_many(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    steps: Sequence[int],
    out_lowp: Sequence[torch.Tensor] | None = None,
    flat: bool = True,
    **hyper: Unpack[AdamScalars],
) -> None:
    """adam_step over many CPU partitions, each with its own step count, in one native call: one
    parallel region for the whole list instead of one fork/join per tensor. For tiered.optim.CPUAdam
    (flat=False: contiguous tensors of any equal shape) and gpu_adam_step's CPU lists; the caller
    checks the step counts. The C++ binding checks every tensor before the kernel touches any and
    raises ValueError naming the index."""
    bound = bind_scalars(1, hyper)
    mod = _loader.cpu_module()
    if mod is None:
        outs = list(out_lowp) if out_lowp is not None else [None] * len(params)
        for p, g, m, v, o, step in zip(params, grads, exp_avgs, exp_avg_sqs, outs, steps, strict=True):
            adam_step_reference(
                p.view(-1), g.view(-1), m.view(-1), v.view(-1), step=step,
                out_lowp=o.view(-1) if o is not None else None, **hyper,
            )  # fmt: skip
        return
    mod.adam_step_many(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                       list(out_lowp) if out_lowp is not None else None, [int(s) for s in steps], *bound,
                       False, flat)  # fmt: skip


def kernel_info() -> dict[str, object]:
    """Which kernel paths run here: {"cpu_adam", "gpu_adam", "threads", "cpu_isas"}."""
    mod = _loader.cpu_module()
    return {
        "cpu_adam": _loader.cpu_status(),
        "gpu_adam": _loader.gpu_status(),
        "threads": mod.num_threads() if mod is not None else torch.get_num_threads(),
        "cpu_isas": list(mod.supported_isas()) if mod is not None else [],
    }
