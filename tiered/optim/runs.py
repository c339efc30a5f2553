"""Per-parameter step counts and hyper-parameters inside a flat shard group, as runs of its shard.

[Note: parameters without a gradient are not stepped]
torch.optim.AdamW (with ``zero_grad(set_to_none=True)``) leaves a parameter whose ``grad`` is None
untouched: no moment update, no weight decay, and its own step count (bias correction) does not
advance. An idle expert of a mixture-of-experts, an untaken branch or an auxiliary head used every
other step is such a parameter. tiered keeps the same rule inside a flat group: the coordinator
records, per group entry, whether a gradient reached it on any micro-batch of the accumulation
window and on any rank (one all_reduce MAX of a uint8 mask per step); `GroupSteps` keeps each
entry's step count as a *lag* behind the optimizer's count (0 while it is stepped every time) and
splits the shard into runs of consecutive entries sharing (stepped?, lag, hyper-parameters). The
kernels get one tensor per run (``adam_step_many`` / ``gpu_adam_step`` take a step per tensor), so
there is no per-parameter Python loop: the runs are computed with tensor ops and cached until the
received set or a lag changes (with every parameter stepped, as in a dense model, one run per
distinct hyper-parameter set). A parameter that received an all-zero gradient is stepped, as in
torch. Padding follows the run of the shard's last entry (zeros stay zeros under Adam).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from tiered.optim.hyper import ParamHyper
from tiered.shards import ShardGroup


class Run(NamedTuple):
    """A slice [start, stop) of a group's shard stepped alike."""

    start: int
    stop: int
    stepped: bool
    lag: int
    """Steps this run's parameters missed: their step count is the optimizer's minus this."""
    hyper: ParamHyper


class GroupSteps:
    """The per-entry step counts of one group and the runs of this rank's shard."""

    def __init__(self, group: ShardGroup, hypers: Sequence[ParamHyper]) -> None:
        self.group = group
        self.names = [e.name for e in group.entries]
        n = len(group.entries)
        self.lag = torch.zeros(n, dtype=torch.int64)
        """Per entry: optimizer steps it was not stepped in (its step count = step_count - lag)."""
        self._hypers = list(dict.fromkeys(hypers))
        hyper_id = torch.tensor([self._hypers.index(h) for h in hypers], dtype=torch.int64)
        in_shard = [(j, s[0]) for j, e in enumerate(group.entries) if (s := group.shard_slice(e)) is not None]
        self._entry = torch.tensor([j for j, _ in in_shard], dtype=torch.int64)
        """Entries with elements in this rank's shard, in shard order."""
        self._start = torch.tensor([s for _, s in in_shard], dtype=torch.int64)
        self._hyper_id = hyper_id[self._entry]
        self._cache: tuple[bytes, int, list[Run]] | None = None
        self._version = 0

    def runs(self, received: torch.Tensor | None) -> list[Run]:
        """The shard's runs for a step in which `received` (uint8 per entry; None: all) got a gradient."""
        if received is None:
            received = torch.ones(len(self.names), dtype=torch.uint8)
        key = received.numpy().tobytes()
        if self._cache is not None and self._cache[0] == key and self._cache[1] == self._version:
            return self._cache[2]
        shard = self.group.shard_numel
        if self._entry.numel() == 0:  # only padding here: zeros, stepped or not alike
            runs = [Run(0, shard, True, 0, self._hypers[0] if self._hypers else ParamHyper(0.0))]
        else:
            stepped = received[self._entry].to(torch.int64)
            lag = self.lag[self._entry]
            hid = self._hyper_id
            change = torch.ones(self._entry.numel(), dtype=torch.bool)
            change[1:] = (stepped[1:] != stepped[:-1]) | (lag[1:] != lag[:-1]) | (hid[1:] != hid[:-1])
            first = torch.nonzero(change).reshape(-1)
            starts = self._start[first].tolist()
            stops = [*starts[1:], shard]
            runs = [
                Run(a, b, bool(s), int(lg), self._hypers[h])
                for a, b, s, lg, h in zip(
                    starts,
                    stops,
                    stepped[first].tolist(),
                    lag[first].tolist(),
                    hid[first].tolist(),
                    strict=True,
                )
            ]
        self._cache = (key, self._version, runs)
        return runs

    def advance(self, received: torch.Tensor | None) -> None:
        """After a step: entries that got no gradient fall one more step behind."""
        if received is None:
            return
        missed = received == 0
        if bool(missed.any()):
            self.lag += missed.to(torch.int64)
            self._version += 1

    def steps(self, step_count: int) -> dict[str, int]:
        """Per parameter name: its own step count (for checkpoints)."""
        return dict(zip(self.names, (step_count - self.lag).tolist(), strict=True))

    def load_steps(self, steps: Mapping[str, int], step_count: int) -> None:
        """Set the per-parameter step counts (a checkpoint's); a name it lacks counts every step."""
        self.lag = torch.tensor(
            [step_count - int(steps.get(n, step_count)) for n in self.names], dtype=torch.int64
        )
        if bool((self.lag < 0).any()):
            bad = [n for n, lg in zip(self.names, self.lag.tolist(), strict=True) if lg < 0]
            raise ValueError(
                f"per-parameter step counts of {bad[:3]} exceed the optimizer step count {step_count}: "
                "the checkpoint's optimizer state is inconsistent"
            )
        self._version += 1


def entry_hypers(
    groups: Sequence[ShardGroup], default: ParamHyper, param_hyper: Mapping[str, ParamHyper] | None
) -> list[list[ParamHyper]]:
    """Per group, per entry: its ParamHyper (`default` where `param_hyper` does not name it).
    A name in `param_hyper` that is no trainable parameter is an error (nothing silently ignored)."""
    param_hyper = dict(param_hyper or {})
    for name, h in param_hyper.items():
        if not isinstance(h, ParamHyper):
            raise TypeError(
                f"param_hyper[{name!r}] must be a tiered.optim.ParamHyper, got {type(h).__name__}"
            )
    known = {e.name for g in groups for e in g.entries}
    unknown = sorted(set(param_hyper) - known)
    if unknown:
        raise ValueError(
            f"param_hyper names {unknown[:5]} which are not trainable parameters of the model "
            f"(known names look like {sorted(known)[:3]}): key it by model.named_parameters() names"
        )
    return [[param_hyper.get(e.name, default) for e in g.entries] for g in groups]
