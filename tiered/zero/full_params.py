"""Whole parameters outside forward: one group gathered at a time, for exports and
``engine.gathered_parameters``.

These walk the coordinator's groups with its own gather and release (so the live budget, pins
and counters stay exact) but are not part of the per-pass schedule: nothing is recorded in the
trace, and what was gathered only for this is evicted again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tiered.shards import ShardGroup
    from tiered.zero.coordinator import ZeroParameters


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
