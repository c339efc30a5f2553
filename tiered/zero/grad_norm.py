"""The step's gradient norm and its non-finite check, over the coordinator's group runtimes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from tiered.zero.grad_home import param_grad_norms
from tiered.zero.group import GradSummary, GroupRuntime


def grad_sq_norm(rt: GroupRuntime) -> float:
    """Squared L2 norm of `rt`'s accumulated fp32 gradient shard, from `grad_norms` (0 for a
    frozen group; a staged gradient's kept norms: nothing read)."""
    return math.fsum(float(n) ** 2 for _, n in grad_norms(rt))


def grad_norms(rt: GroupRuntime) -> list[tuple[str, torch.Tensor]]:
    """(name, fp32 L2 norm) of each parameter's part of `rt`'s accumulated gradient shard
    ([Note: gradient norm as torch's]); none for a frozen group."""
    g = rt.group
    if g.grad is None:
        return []
    if rt.grad_zero_pending:  # no gradient reached it: zeros, as the optimizer reads
        return [(n, torch.zeros(())) for n, _ in param_grad_norms(g, torch.zeros(g.shard_numel))]
    if rt.grad_staged:
        return rt.staged_norms
    return param_grad_norms(g, rt.home_view(g.grad))


def local_grad_summary(
    runtimes: Sequence[GroupRuntime], world_size: int, param_order: Mapping[str, int]
) -> GradSummary:
    """This rank's squared gradient norm and overflow flag, as clip_grad_norm_ computes it."""
    # [Note: gradient norm as torch's]
    # The clip coefficient scales every gradient of the step, and Adam carries a relative
    # change of it in exp_avg into the following steps, where a loss surface can amplify it:
    # on the demo's 20 steps, plain PyTorch clipped by the exact (float64) norm instead of its
    # own ends 1.1e-4 away from plain PyTorch, ten times torch's fused-vs-foreach spread. And
    # torch's fp32 norm is not exact (up to ~1e-5 relative on real gradients, torch 2.13 CPU).
    # So the norm is taken as torch.nn.utils.clip_grad_norm_ takes it: the fp32 L2 norm of
    # each parameter's gradient (torch.linalg.vector_norm on it), then the norm of those
    # norms stacked in the model's parameter order, rounded as torch rounds, not more exactly.
    # Across ranks a parameter's gradient is split, so no rank holds torch's operand: each
    # rank sums the squares of its parts' norms in float64 and the ranks sum those.
    per_group = [(rt, grad_norms(rt)) for rt in runtimes]
    norms = _whole([nm for _, group_norms in per_group for nm in group_norms])
    if not norms:
        return GradSummary(found_inf=False, sq_norm_local=0.0)
    if world_size > 1:
        sq = math.fsum(float(n) ** 2 for _, n in norms)
    else:
        norms.sort(key=lambda nm: param_order.get(nm[0], len(param_order)))
        dev = norms[0][1].device
        total = torch.linalg.vector_norm(torch.stack([n.to(dev) for _, n in norms]))
        sq = float(total) ** 2  # exact in float64: its square root is `total` again
    if math.isfinite(sq):
        return GradSummary(found_inf=False, sq_norm_local=sq)
    first = next(  # None where only the sum overflowed
        (rt.group.name for rt, gn in per_group if not all(math.isfinite(float(n)) for _, n in gn)), None
    )
    return GradSummary(found_inf=True, sq_norm_local=sq, nonfinite_group=first)


def _whole(norms: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """One norm per parameter: the pieces of one planned in pieces ([Note: fused parameters in
    pieces] in tiered/zero/split.py) joined as the norm of their norms."""
    by_name: dict[str, list[torch.Tensor]] = {}
    for n, t in norms:
        by_name.setdefault(n, []).append(t)
    return [
        (n, ts[0] if len(ts) == 1 else torch.linalg.vector_norm(torch.stack(ts))) for n, ts in by_name.items()
    ]


def probed_nonfinite_group(runtimes: Sequence[GroupRuntime]) -> str | None:
    """The first group whose recorded gradient sums were not finite (and clears the records)."""
    probes = [(rt, p) for rt in runtimes if rt.finite_probes for p in rt.finite_probes]
    staged = [rt for rt in runtimes if rt.finite_probes is not None and rt.grad_staged]
    for rt in runtimes:
        if rt.finite_probes:
            rt.finite_probes = []
    first = next((rt for rt in staged if not math.isfinite(grad_sq_norm(rt))), None)  # kept, no read
    if probes:
        dev = probes[0][1].device
        bad = (~torch.isfinite(torch.stack([p.to(dev) for _, p in probes]).cpu())).nonzero()  # one sync
        if bad.numel():
            rt = probes[int(bad[0])][0]
            first = rt if first is None or rt.index < first.index else first
    return None if first is None else first.group.name
