"""The ranks agree on each ZeRO-3 collective before they issue it.

[Note: collective order check]
The gathers and gradient reductions of ZeRO-3 are collectives issued in graph order (see [Note:
leaf modules] in tiered/zero/leaf.py). When two ranks' graphs differ and no leaf module covers
the difference, the collectives they issue differ: with mismatched sizes gloo raises an error
that names nothing, or both ranks wait forever; with equal sizes (two layers' groups) the
gradients of one are silently averaged with those of another. So before each gather, each
reduction, the end-of-backward agreement and the "received" masks, every rank contributes
(kind, group index) to a small all-gather, and compares: a difference raises
`CollectiveOrderError` on every rank at once, before any data moves, naming what each rank was
doing, the modules, and the leaf module declaration that makes the graphs agree. For that advice
the ranks, all in the error path together, exchange what each knows (one more all-gather): its
forward stack, the modules it entered in this pass, and the parameters of the groups involved
that its backward passed over while reaching others of the group. The leaf proposed is the
parent of such routed-around parameters, or else the deepest module of a rank's forward stack
that every other rank also ran (it ran different children on different ranks), or else the
nearest common ancestor, with a forward of its own, of the groups' modules.

The check runs on a CPU (gloo) group: the process group itself when it is gloo, otherwise a gloo
group over the same ranks made once at initialize, so that an NCCL job pays a few tens of
microseconds of host round trip per collective and never a device synchronisation. It is on by
default with several ranks; ``tiered.check_collective_order: false`` turns it off (a run that
is known to agree then saves one small host collective per gather and reduction). A rank that
never reaches the next collective at all (it stopped, or waits in a collective of the user's)
still leaves the other waiting; that wait ends with the process group's timeout
(``init_process_group(timeout=...)``), as any collective's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tiered.errors import CollectiveOrderError
from tiered.zero import comm
from tiered.zero.leaf import advise_leaf, describe_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from tiered.shards import ShardGroup

GATHER = 1
REDUCE = 2
END_BACKWARD = 3
RECEIVED = 4
_KIND_NAMES = {
    GATHER: "gathers",
    REDUCE: "reduces the gradients of",
    END_BACKWARD: "ends backward (agreeing which groups still hold gradients)",
    RECEIVED: "ends the accumulation window (the received-gradient masks)",
}


def check_group(process_group: ProcessGroup | None) -> ProcessGroup | None:
    """The gloo group the checks run on: `process_group` itself when it is gloo, else a new gloo
    group over its ranks (every rank of it calls this at initialize, in the same order)."""
    if str(dist.get_backend(process_group)).lower() == "gloo":
        return process_group
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    checks: ProcessGroup | None
    if ranks is None:
        checks = dist.new_group(backend="gloo")
    else:
        checks = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    return checks


class CollectiveOrder:
    """One model's check (see the module docstring), over its `groups` (by index)."""

    def __init__(
        self,
        process_group: ProcessGroup | None,
        model: nn.Module,
        groups: Sequence[ShardGroup],
        context: Callable[[list[int]], dict[str, Any]],
    ) -> None:
        """`context(groups)`: what this rank knows of a divergence involving `groups`, for the
        advice (tiered/zero/leaf.py's `local_context` and `advise_leaf`)."""
        self._pg = check_group(process_group)
        self._ws = dist.get_world_size(process_group)
        self._model = model
        self._groups = groups
        self._context = context
        self.checks = 0
        """Collectives checked so far (stats)."""

    def agree(self, kind: int, group: int = -1) -> None:
        """Every rank is about to issue the collective (`kind`, `group`); or CollectiveOrderError."""
        mine = torch.tensor([kind, group], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self._ws)]
        dist.all_gather(every, mine, group=self._pg)
        self.checks += 1
        tags = [(int(t[0]), int(t[1])) for t in every]
        if all(t == tags[0] for t in tags):
            return
        raise CollectiveOrderError(self._message(tags))

    def _message(self, tags: list[tuple[int, int]]) -> str:
        lines = []
        for rank, (kind, group) in enumerate(tags):
            what = _KIND_NAMES.get(kind, f"collective {kind}")
            lines.append(
                f"rank {rank} {what}" + (f" {describe_group(self._groups[group])}" if group >= 0 else "")
            )
        groups = sorted({g for _, g in tags if g >= 0})
        kinds = {k for k, _ in tags}
        every: list[Any] = [None] * self._ws  # every rank is here: it saw the same tags
        dist.all_gather_object(every, self._context(groups), group=self._pg)
        return (
            "the ranks' ZeRO-3 collectives diverge (their graphs differ: routing, a branch, or a "
            "parameter used on some ranks only): "
            + "; ".join(lines)
            + ". "
            + advise_leaf(self._model, [self._groups[i] for i in groups], kinds == {GATHER}, every)
        )


def masks_over_ranks(
    masks: Sequence[torch.Tensor],
    order: CollectiveOrder | None,
    process_group: ProcessGroup | None,
    world_size: int,
) -> list[torch.Tensor]:
    """uint8 masks OR-ed over the ranks: one all_reduce (MAX) of them concatenated, agreed first
    as RECEIVED (copies where there is one rank)."""
    if world_size == 1 or not masks:
        return [m.clone() for m in masks]
    flat = torch.cat(list(masks))
    if order is not None:
        order.agree(RECEIVED)
    comm.all_reduce_max_(flat, process_group)
    return list(torch.split(flat, [m.numel() for m in masks]))


def union_over_ranks(
    flags: Sequence[bool], order: CollectiveOrder | None, process_group: ProcessGroup | None
) -> list[bool]:
    """Each flag OR-ed over the ranks (one small all-reduce, agreed first as END_BACKWARD)."""
    t = torch.tensor(list(flags), dtype=torch.uint8)
    if order is not None:
        order.agree(END_BACKWARD)
    comm.all_reduce_max_(t, process_group)
    return [bool(v) for v in t.tolist()]
