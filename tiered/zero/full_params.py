"""Whole parameters outside forward: one group gathered at a time, for exports and
``engine.gathered_parameters``.

These walk the coordinator's groups with its own gather and release (so the live budget, pins
and counters stay exact) but are not part of the per-pass schedule: nothing is recorded in the
trace, and what was gathered only for this is evicted again.

[Note: restore at close group by group]
``engine.close()`` (``restore_weights``, the default) gives every parameter its trained value
back as a plain CPU tensor. Gathering all of them first and assigning them after would hold the
whole model in the compute dtype on top of everything the tiers still hold: the process's host
peak came at close, by about the model's 16-bit bytes (measured in benchmarks/RESULTS.md, issue
21; 72.6 GB for the 36B headline, which would not fit 64 GB of host memory). Instead each group
is gathered, copied out, and its partitions (parameter, gradient, optimizer states, the gathered
buffer of several ranks) dropped from the tiers before the next group is gathered; a partition
homed on a persistent tier of the user's keeps its (flushed) home and loses only its copies in
memory. The bytes must leave the process, not only the tiers' accounting: the group's cached home
tensors are forgotten and the memory backends give their pools' free buffers back
(`StorageBackend.release_cached`), else the restored copies would come on top of them. The copies therefore grow by one group while the tiers shrink by at least that group's
parameter bytes: close's peak is the tiers' at most plus one group's copy in the compute dtype,
which the memory model counts (`tiered.planning.needs.outside_tiers_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tiered.shards import ShardGroup
    from tiered.zero.coordinator import ZeroParameters
    from tiered.zero.group import GroupRuntime


def iter_full_groups(zp: ZeroParameters) -> Iterator[tuple[ShardGroup, list[tuple[str, torch.Tensor]]]]:
    """Each group gathered in turn (a collective with several ranks), its parameters as (name,
    full tensor) views into the gathered buffer, valid until the next iteration; then released,
    and evicted again unless it was resident before (the reuse cache would otherwise keep every
    group). Never more than one group at once."""
    for rt in zp.runtimes:
        g = rt.group
        was_resident = g.param.state("gpu").resident
        zp._gather(rt.index, record=False)
        try:
            yield g, [(e.name, p.detach()) for e, p in zip(g.entries, rt.params, strict=True)]
        finally:
            zp._release(rt.index)
            if rt.needs_fetch and not g.persistent and not was_resident:
                rt.evict()


@contextmanager
def gathered(
    zp: ZeroParameters, params: Iterable[nn.Parameter]
) -> Iterator[list[tuple[ShardGroup, torch.Tensor]]]:
    """The groups holding `params` gathered (their ``.data`` the full values) until exit; yields
    (group, full flat buffer) per group."""
    idxs: set[int] = set()
    unknown: list[tuple[int, ...]] = []
    for p in params:
        if id(p) in zp.managed:
            idxs.add(zp.managed[id(p)][0])
        else:
            unknown.append(tuple(p.shape))
    if unknown:
        raise ValueError(
            f"gathered_parameters: {len(unknown)} tensors (shapes {unknown[:3]}) are not parameters this engine manages"
        )
    done: list[int] = []
    try:
        for i in sorted(idxs):
            zp._gather(i, record=False)
            done.append(i)
        out = []
        for i in done:
            full = zp.runtimes[i].full
            assert full is not None  # pinned by the gather above
            out.append((zp.runtimes[i].group, full))
        yield out
    finally:
        for i in reversed(done):
            zp._release(i)


def restore_full_groups(zp: ZeroParameters, free: Callable[[GroupRuntime], None]) -> None:
    """Give each managed parameter its full value back as a plain CPU tensor, one group at a
    time: gather the group, copy its parameters out, release it, let `free` drop that group's
    partitions from the tiers, then point the parameters at the copies. So the copies and the
    tiers together never hold more than the tiers did plus one group ([Note: restore at close
    group by group]). Call it with the hooks removed (the parameters' ``.data`` is assigned);
    a group whose gather fails raises, leaving the groups before it restored."""
    for rt in zp.runtimes:
        zp._gather(rt.index, record=False)
        try:
            copies = [p.detach().to("cpu", copy=True) for p in rt.params]
        finally:
            zp._release(rt.index)
        rt.forget_prefetch()
        rt.wait_evicted()  # (release may have started one; `free` drops every copy)
        free(rt)
        with torch.no_grad():
            for p, t in zip(rt.params, copies, strict=True):
                p.data = t
