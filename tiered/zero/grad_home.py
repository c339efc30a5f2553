"""A gradient partition whose home is not memory (``tiered.grad_tier: "nvme"``): staged per flush.

[Note: gradients on nvme]
With the optimizer offloaded the fp32 gradients would need 4 bytes per parameter of host memory
(160 GB for 40B parameters). With ``tiered.grad_tier`` naming a storage tier (nvme), a group's
gradient partition lives there instead: each flush stages it in "cpu" (read from home when
this backward's gradients are added to it under accumulation; only allocated, not read, at the
first flush after zeroing, which overwrites all of it), adds or copies this backward's
gradients, writes it back and frees the staged copy, so host memory holds one group's gradient
at a time (and a step without accumulation reads no gradient before the optimizer does). The
per-parameter norms of the values written are kept per group ([Note: gradient norm as torch's]),
so the global norm for clipping is taken on the same fp32 values the optimizer reads without
reading every gradient again at the end of backward. The optimizer fetches each group's gradient from its
home like its states (tiered/optim/offload.py already does so for any gradient home).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tiered.shards import ShardGroup
    from tiered.tiers import Partition, TierManager

STAGE_TIER = "cpu"


def param_grad_norms(group: ShardGroup, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(parameter name, fp32 L2 norm of its part of the flat gradient shard `t`) for each
    parameter of `group` this shard holds, as torch.linalg.vector_norm computes it on the
    parameter's own gradient ([Note: gradient norm as torch's] in tiered/zero/grad_norm.py)."""
    norms = []
    for entry in group.entries:
        where = group.shard_slice(entry)
        if where is None:
            continue
        start, _, length = where
        part = t[start : start + length]
        # the whole parameter in its own shape: torch reduces the gradient tensor itself
        whole = length == entry.numel and not entry.is_piece
        norms.append((entry.name, torch.linalg.vector_norm(part.view(entry.shape) if whole else part)))
    return norms


def is_staged(tm: TierManager, part: Partition) -> bool:
    """True when `part`'s home is not addressable memory (its home view cannot be held)."""
    return not tm.tier(part.home).backend.capabilities.memory_like


class GradKeeper(Protocol):
    """Who consumes the gradients a flush keeps in "cpu" (the overlapped step's `KeptGrads`,
    [Note: backward waits instead of parking] in tiered/optim/kept_grads.py)."""

    def admit(self, part: Partition) -> None:
        """Block until `part` may be staged and kept without parking another kept gradient."""
        ...

    def kept(self, part: Partition) -> None:
        """`part` was left in "cpu", dirty, for its step."""
        ...


class StagedGradHome:
    """One group's gradient partition homed in a storage tier; see [Note: gradients on nvme]."""

    def __init__(self, tm: TierManager, group: ShardGroup, part: Partition) -> None:
        self.tm = tm
        self.group = group
        self.part = part
        self.staged: torch.Tensor | None = None
        self.norms: list[tuple[str, torch.Tensor]] = []
        """Per-parameter norms of the values last written (`param_grad_norms`)."""
        self.keeper: GradKeeper | None = None
        """Set while flushes keep the gradient for the step (`ZeroParameters.keep_flushed_grads`)."""

    def open(self, *, overwrite: bool = False, keeping: bool = False) -> torch.Tensor:
        """The partition's values in "cpu", to be modified in place and then `write_back()`;
        with `overwrite` the caller writes every element, so nothing is read from home;
        `keeping`: a flush that will keep it there, admitted by the keeper first."""
        if self.staged is None:
            if keeping and self.keeper is not None:
                self.keeper.admit(self.part)
            tm = self.tm
            fut = tm.allocate(self.part, STAGE_TIER) if overwrite else tm.fetch(self.part, STAGE_TIER)
            self.staged = fut.result()
        return self.staged

    def write_back(self, *, keep: bool = False) -> None:
        """The staged values are final: written home and freed, or with `keep` left in "cpu",
        dirty and unpinned, for the optimizer step to consume from memory ([Note: gradient
        consumed from memory] in tiered/optim/group.py; the manager still writes it home
        should the cpu budget need its room first)."""
        t, self.staged = self.staged, None
        assert t is not None, f"{self.part.name}: write_back without open"
        self.norms = param_grad_norms(self.group, t)
        tm = self.tm
        tm.mark_dirty(self.part, STAGE_TIER)
        tm.release(self.part, STAGE_TIER)
        if not keep:
            # written home before the staged copy is freed, unless the tier keeps it ([Note: residency])
            tm.settle(self.part, STAGE_TIER).result()
        elif self.keeper is not None:
            self.keeper.kept(self.part)

    def read_copy(self) -> torch.Tensor:
        tm = self.tm
        t = tm.fetch(self.part, STAGE_TIER).result().clone()
        tm.release(self.part, STAGE_TIER)
        tm.settle(self.part, STAGE_TIER).result()  # clean: frees it (a kept copy stays)
        return t
