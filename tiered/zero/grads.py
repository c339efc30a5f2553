"""The gradient path: complete groups leave the compute device for their fp32 home.

[Note: gradient flush]
Each managed parameter that requires grad carries a post-accumulate-grad hook. When every such
parameter of a group has its gradient for this backward, the group is *flushed*: its gradients
are added (fp32) into the group's gradient partition in its home tier (see [Note: home views]),
after a reduce-scatter (rank average) when world_size > 1; then
``param.grad`` is dropped and the group's backward gather is released. Groups that are only
partly complete at the end of backward (unused parameters) are flushed by `finish_backward`,
missing gradients counting as zeros; with world_size > 1 every rank must then flush the same
groups, which holds when every rank runs the same graph (as DeepSpeed also requires). Adding
into the accumulated fp32 shard is exactly what plain PyTorch's ``param.grad`` accumulation does
in fp32, so gradient accumulation stays bitwise equal.

[Note: lazy gradient zeroing]
``zero_grads`` only marks the groups; the first flush of a group after it *copies* the gradient
into the partition (padding and missing gradients written as zeros) instead of adding it to
zeros: one pass over the partition fewer and a lighter one (on benchmarks/step.py: a 143 MB
memset and a read stream per step). ``0 + g`` and ``g`` are equal except for the sign of a zero,
which is then plain PyTorch's. Groups no gradient reached are zeroed for real at the end of
backward, before anything (the norm, the optimizer) reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiered.zero import comm

if TYPE_CHECKING:
    from tiered.zero.groups import ShardGroup
    from tiered.zero.params import ZeroParameters


@dataclass(frozen=True)
class GradSummary:
    found_inf: bool
    """Some accumulated gradient element is inf or NaN (fp16 overflow: skip the step)."""
    sq_norm_local: float
    """Squared L2 norm of this rank's shard of the accumulated fp32 gradients."""


class GradMixin:
    """Gradient methods of ZeroParameters. See [Note: gradient flush]."""

    def on_group_grads_complete(self: ZeroParameters, callback: Callable[[ShardGroup], None]) -> None:
        """Call `callback(group)` each time a group's gradients for this backward were flushed."""
        self._grad_callbacks.append(callback)

    def seal_for_step(self: ZeroParameters, group: ShardGroup) -> None:
        """The optimizer is about to update `group` while backward continues (see [Note: step
        overlapped with backward] in tiered/optim/offload.py): any later gather of it in this
        backward would see new values, so it raises instead. Unsealed when the pass ends."""
        self._sealed.add(group.index)

    def _grad_arriving(self: ZeroParameters, p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        i = self._managed[id(p)][0]

        def hook(grad: torch.Tensor) -> None:
            if self._st[i].full is None:
                self._counters["backward_on_demand"] += 1
                self._bw_gather(i)

        return hook

    def _on_grad_ready(self: ZeroParameters, p: nn.Parameter) -> None:
        i, _ = self._managed[id(p)]
        st = self._st[i]
        st.grads_seen.add(id(p))
        if len(st.grads_seen) >= st.n_req_grad:
            self._flush(i)

    def _flush(self: ZeroParameters, i: int) -> None:
        g, st = self.groups[i], self._st[i]
        grads = [(e, p.grad) for e, p in zip(g.entries, st.params, strict=True)]
        fresh = i in self._grad_zero_pending  # see [Note: lazy gradient zeroing]
        self._grad_zero_pending.discard(i)
        with torch.no_grad():
            if self.world_size == 1:
                t = self._home_view(g.grad)
                for e, gr in grads:
                    dst = t[e.offset : e.offset + e.numel]
                    if gr is not None:
                        dst.copy_(gr.reshape(-1)) if fresh else dst.add_(gr.reshape(-1).to(t.device))
                    elif fresh:
                        dst.zero_()
                if fresh:
                    t[g.numel :].zero_()  # alignment padding (entries fill [0, numel) in order)
                self._home_written(g.grad)
            else:
                dev = next((gr.device for _, gr in grads if gr is not None), self.device)
                full = torch.zeros(g.full_numel, dtype=torch.float32, device=dev)
                for e, gr in grads:
                    if gr is not None:
                        full[e.offset : e.offset + e.numel].copy_(gr.reshape(-1))
                shard = comm.reduce_scatter_mean(full, self.process_group)
                t = self._home_view(g.grad)
                t.copy_(shard) if fresh else t.add_(shard.to(t.device))
                self._home_written(g.grad)
        for p in st.params:
            p.grad = None
        st.grads_seen.clear()
        self._counters["grad_flushes"] += 1
        self._bw_release(i)
        for cb in self._grad_callbacks:
            cb(g)

    def finish_backward(self: ZeroParameters, *, summarize: bool = True) -> GradSummary:
        """End of backward: flush partly complete groups, release everything, end the pass, and
        (if `summarize`) return the local squared norm and overflow flag of the accumulated grads."""
        for i, st in enumerate(self._st):
            # partly complete groups; also grads set without the hook firing (retain_graph reuse)
            if st.grads_seen or any(p.grad is not None for p in st.params):
                self._flush(i)
        self._zero_pending_grads()  # groups that got no gradient at all: now really zero
        self._end_pass()
        self._in_backward = False
        if not summarize:
            return GradSummary(False, 0.0)
        return self.grad_summary()

    def grad_summary(self: ZeroParameters) -> GradSummary:
        sq = 0.0
        for g in self.groups:
            if g.grad is None:
                continue
            t = self._home_view(g.grad)
            sq += float(torch.dot(t, t).item()) if t.numel() else 0.0
        return GradSummary(found_inf=not math.isfinite(sq), sq_norm_local=sq)

    def zero_grads(self: ZeroParameters) -> None:
        """Set every group's accumulated gradient to zero on its tier (lazily: see [Note: lazy
        gradient zeroing])."""
        self._grad_zero_pending.update(g.index for g in self.groups if g.grad is not None)
        for st in self._st:
            st.grads_seen.clear()
            for p in st.params:
                p.grad = None

    def _zero_pending_grads(self: ZeroParameters) -> None:
        for i in sorted(self._grad_zero_pending):
            g = self.groups[i]
            self._home_view(g.grad).zero_()
            self._home_written(g.grad)
        self._grad_zero_pending.clear()

    def read_grad_shard(self: ZeroParameters, group: ShardGroup) -> torch.Tensor:
        """A CPU copy of this rank's accumulated fp32 gradient shard (tests, checkpoints)."""
        if group.grad is None:
            raise ValueError(f"group {group.name} is frozen (requires_grad=False): it has no gradient")
        if group.index in self._grad_zero_pending:
            return torch.zeros(group.shard_numel, dtype=torch.float32)
        return self._home_view(group.grad).detach().to("cpu", copy=True)
