"""The fused Adam kernels applied to one group's tensors, run by run (stateless: one call per
update; the pipeline in tiered/optim/offload.py decides what is resident where).

[Note: parameters without a gradient are not stepped] (tiered/optim/runs.py) says why a shard is
stepped in runs; a shard stepped alike takes one kernel call on one tensor, as ever.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tiered.config.schema import OptimizerConfig
from tiered.optim.runs import ParamHyper, Run


def _ext() -> Any:
    import tiered_ext

    return tiered_ext


def kernel_args(
    opt: OptimizerConfig, run: Run, step_count: int, lr: float, grad_scale: float
) -> dict[str, Any]:
    """The kernels' keyword arguments for `run` at optimizer step `step_count`."""
    return dict(
        step=step_count - run.lag,
        lr=float(lr) * run.hyper.lr_scale,
        beta1=float(opt.betas[0]),
        beta2=float(opt.betas[1]),
        eps=float(opt.eps),
        weight_decay=float(run.hyper.weight_decay),
        adamw_mode=bool(opt.adamw_mode),
        grad_scale=float(grad_scale),
    )


def adam_update(
    opt: OptimizerConfig,
    runs: Sequence[Run],
    side: str,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    out_lowp: torch.Tensor | None,
    *,
    step_count: int,
    lr: float,
    grad_scale: float,
) -> None:
    """Update (master, grad, exp_avg, exp_avg_sq) in place, `runs` indexing into them; the new
    compute-dtype parameter written into `out_lowp` in the same pass (None: fp32, or master is
    the parameter)."""
    master, grad, exp_avg, exp_avg_sq = tensors
    ext = _ext()
    if len(runs) == 1 and runs[0].stepped:  # the whole shard alike: one tensor, as ever
        kw = kernel_args(opt, runs[0], step_count, lr, grad_scale)
        if side == "cpu":
            ext.adam_step(master, grad, exp_avg, exp_avg_sq, out_lowp=out_lowp, **kw)
        else:
            ext.gpu_adam_step(
                [master],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                out_lowp=None if out_lowp is None else [out_lowp],
                **kw,
            )
        return
    by_hyper: dict[ParamHyper, list[Run]] = {}
    for r in runs:
        if r.stepped:
            by_hyper.setdefault(r.hyper, []).append(r)
        elif out_lowp is not None:  # a fresh staging buffer: it must hold the unchanged values
            out_lowp[r.start : r.stop].copy_(master[r.start : r.stop])
    for hyper_runs in by_hyper.values():
        kw = kernel_args(opt, hyper_runs[0], step_count, lr, grad_scale)
        del kw["step"]

        def cut(t: torch.Tensor) -> list[torch.Tensor]:
            return [t[r.start : r.stop] for r in hyper_runs]  # noqa: B023 (used at once)

        outs = cut(out_lowp) if out_lowp is not None else None
        steps = [step_count - r.lag for r in hyper_runs]
        if side == "cpu":
            ext.check_scalars(step=min(steps), **{k: v for k, v in kw.items() if k != "adamw_mode"})
            ext._adam_step_many(
                cut(master), cut(grad), cut(exp_avg), cut(exp_avg_sq), steps=steps, out_lowp=outs, **kw
            )
        else:
            ext.gpu_adam_step(
                cut(master), cut(grad), cut(exp_avg), cut(exp_avg_sq), step=steps, out_lowp=outs, **kw
            )
