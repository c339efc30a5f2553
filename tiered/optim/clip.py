"""Global gradient norm across ranks and the clip coefficient, as torch.nn.utils.clip_grad_norm_.

[Note: clipping by grad_scale]
The gradients never get multiplied in place: the optimizer kernel multiplies each gradient by a
scalar on the fly (``grad_scale``), so clipping and fp16 unscaling cost no extra pass over the
gradients: ``grad_scale = clip_coef / loss_scale``. The norm is computed once per step from each
rank's local squared norm (its shard of the accumulated fp32 gradients, taken as torch takes it:
[Note: gradient norm as torch's] in tiered/zero/grad_norm.py), summed over the data-parallel
group in float64, so every rank computes the same coefficient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def global_grad_norm(sq_norm_local: float, *, process_group: dist.ProcessGroup | None = None) -> float:
    """sqrt(sum over ranks of the local squared L2 norms); inf/nan propagate."""
    total = float(sq_norm_local)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=process_group)
        total = float(t.item())
    return math.sqrt(total) if total >= 0 else float("nan")


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """min(1, max_norm / (total_norm + 1e-6)), exactly torch.nn.utils.clip_grad_norm_'s rule.

    ``max_norm <= 0`` means no clipping (DeepSpeed's ``gradient_clipping: 0``).
    """
    if max_norm <= 0:
        return 1.0
    if not math.isfinite(total_norm):
        # torch would multiply by nan/0; a non-finite norm is handled by the caller (overflow).
        return 1.0
    # torch computes the coefficient in the gradients' dtype (fp32): match its rounding.
    coef = torch.tensor(max_norm, dtype=torch.float32) / (
        torch.tensor(total_norm, dtype=torch.float32) + 1e-6
    )
    return float(torch.clamp(coef, max=1.0).item())
