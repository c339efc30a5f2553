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

from tiered.zero.split import units_of

if TYPE_CHECKING:
    from tiered.shards import ShardGroup
    from tiered.zero.coordinator import ZeroParameters
    from tiered.zero.group import GroupRuntime


def export_order(zp: ZeroParameters) -> list[ShardGroup]:
    """The groups in the order `iter_full_groups` gathers them."""
    return [zp.groups[i] for unit in units_of(len(zp.runtimes), zp.splits.values()) for i in unit]


def iter_full_groups(zp: ZeroParameters) -> Iterator[tuple[ShardGroup, list[tuple[str, torch.Tensor]]]]:
    """Each group gathered in turn (a collective with several ranks), its parameters as (name,
    full tensor) views into the gathered buffer, valid until the next iteration; then released,
    and evicted again unless it was resident before (the reuse cache would otherwise keep every
    group). Never more than one group at once, except the groups of a parameter in pieces, which
    come together: it is listed whole, with its first piece ([Note: fused parameters in pieces]
    in tiered/zero/split.py)."""
    for unit in units_of(len(zp.runtimes), zp.splits.values()):
        rts = [zp.runtimes[i] for i in unit]
        was_resident = [rt.group.param.state("gpu").resident for rt in rts]
        try:
            for rt in rts:
                zp._gather(rt.index, record=False)
            for rt in rts:
                g = rt.group
                yield (
                    g,
                    [(e.name, p.detach()) for e, p in zip(g.entries, rt.params, strict=True) if e.start == 0],
                )
        finally:
            for rt, was in zip(reversed(rts), reversed(was_resident), strict=True):
                if rt.pins:
                    zp._release(rt.index)
                if rt.needs_fetch and not rt.group.persistent and not was:
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
            idxs.update(zp.groups_of_param(p))
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


def take_piece_values(zp: ZeroParameters, groups: Iterable[ShardGroup]) -> None:
    """Copy the values of the parameters in pieces (modified in place in their whole buffers) back
    into their pieces' gathered buffers, before those are written back ([Note: fused parameters
    in pieces] in tiered/zero/split.py)."""
    for g in groups:
        rt = zp.runtimes[g.index]
        for j, sp in rt.pieces.items():
            e, values = g.entries[j], sp.values_of(g.entries[j])
            if values is not None and rt.full is not None:
                rt.full[e.offset : e.offset + e.numel].copy_(values)


def restore_full_groups(zp: ZeroParameters, free: Callable[[GroupRuntime], None]) -> None:
    """Give each managed parameter its full value back as a plain CPU tensor, one group at a
    time: gather the group, copy its parameters out, release it, let `free` drop that group's
    partitions from the tiers, then point the parameters at the copies. So the copies and the
    tiers together never hold more than the tiers did plus one group ([Note: restore at close
    group by group]). Call it with the hooks removed (the parameters' ``.data`` is assigned);
    a group whose gather fails raises, leaving the groups before it restored."""
    for unit in units_of(len(zp.runtimes), zp.splits.values()):  # a parameter's pieces together
        rts = [zp.runtimes[i] for i in unit]
        done: list[int] = []
        try:
            for rt in rts:
                zp._gather(rt.index, record=False)
                done.append(rt.index)
            copies = {id(p): (p, p.detach().to("cpu", copy=True)) for rt in rts for p in rt.params}
        finally:
            for i in reversed(done):
                zp._release(i)
        for rt in rts:
            rt.forget_prefetch()
            rt.wait_evicted()  # (release may have started one; `free` drops every copy)
            free(rt)
        with torch.no_grad():
            for p, t in copies.values():
                p.data = t
