"""gpu_adam_step: the multi-tensor Adam step for partitions in GPU memory.

One kernel launch per group of tensors sharing (grad, state, out) dtypes. Lists of CPU tensors
(the "gpu" tier of a CPU-only machine) run the native CPU kernel per tensor; CUDA tensors without
a built CUDA kernel run the pure-torch reference (with a KernelBuildWarning, see _loader).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from . import _loader
from ._reference import adam_step_reference
from ._validate import AdamScalars, BoundScalars, bind_scalars, check_tensors


def check_lists(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    out_lowp: Sequence[torch.Tensor] | None,
    *,
    device_type: str | None,
    step: int,
    hyper: Mapping[str, Any],
) -> tuple[list[torch.Tensor | None], BoundScalars]:
    """The checks of a multi-tensor step: aligned lists, valid scalars, every partition's buffers
    (check_tensors) and one device for all; returns out_lowp as a list (None entries without it)
    and the bound scalars."""
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if out_lowp is not None:
        lists["out_lowp"] = out_lowp
    for name, seq in lists.items():
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} tensors but params has {n}: the lists must align")
    bound = bind_scalars(step, hyper)
    outs: list[torch.Tensor | None] = list(out_lowp) if out_lowp is not None else [None] * n
    for i in range(n):
        check_tensors(
            params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], outs[i], device_type=device_type, where=f"[{i}]"
        )
        if params[i].device != params[0].device:
            raise ValueError(
                f"params[{i}] is on {params[i].device} but params[0] is on {params[0].device}: one device per call"
            )
    return outs, bound


def gpu_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int | Sequence[int],
    out_lowp: Sequence[torch.Tensor] | None = None,
    **hyper: Unpack[AdamScalars],
) -> None:
    """Adam/AdamW step over lists of flat partitions on one device (same semantics as adam_step).
    `step` is one count for all, or one per tensor (parameters stepped a different number of
    times: tiered/optim/runs.py); the CUDA kernel runs once per distinct count."""
    n = len(params)
    steps = [int(step)] * n if isinstance(step, int) else [int(s) for s in step]
    if len(steps) != n:
        raise ValueError(f"step has {len(steps)} counts but params has {n}: one per tensor, or one int")
    outs, bound = check_lists(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        out_lowp,
        device_type=None,
        step=min(steps, default=1),
        hyper=hyper,
    )
    if n == 0:
        return
    device = params[0].device
    if device.type != "cuda":
        if device.type != "cpu":
            for i in range(n):
                adam_step_reference(
                    params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out_lowp=outs[i], step=steps[i], **hyper
                )
            return
        from . import _adam_step_many  # the CPU kernel; imported here to keep the package import acyclic

        if out_lowp is not None and any(o is None for o in outs):
            raise ValueError("out_lowp holds None: pass a tensor for every param, or out_lowp=None")
        _adam_step_many(params, grads, exp_avgs, exp_avg_sqs, steps=steps, out_lowp=out_lowp, **hyper)
        return
    mod = _loader.gpu_module()
    if mod is None:
        for i in range(n):
            adam_step_reference(
                params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out_lowp=outs[i], step=steps[i], **hyper
            )
        return
    groups: dict[tuple[int, torch.dtype, torch.dtype, torch.dtype | None], list[int]] = {}
    for i in range(n):
        out = outs[i]
        key = (steps[i], grads[i].dtype, exp_avgs[i].dtype, out.dtype if out is not None else None)
        groups.setdefault(key, []).append(i)
    for (step_i, _, _, out_dtype), idx in groups.items():
        mod.gpu_adam_step(
            [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx], [outs[i] for i in idx] if out_dtype is not None else None,
            int(step_i), *bound,
        )  # fmt: skip
