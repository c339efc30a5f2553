"""What lasts one pass (a forward and its backward): the modes active during the engine's
forward, the groups held for backward, the groups sealed for an overlapped step.

Owned by the coordinator (tiered/zero/coordinator.py); begun by the root module's forward
pre-hook, ended when its backward finishes (or, without a backward, when the forward does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiered.zero.group import GroupRuntime
from tiered.zero.hooks import ExternalParamMode, HookTarget
from tiered.zero.saved import SavedTensorRefs
from tiered.zero.schedule import Trace

_FROZEN_KEEP = 2
"""Frozen groups gathered in backward stay until this many newer ones were gathered."""


class BackwardHolds:
    """The groups gathered for the running backward, held until their gradients are flushed;
    frozen groups (no gradient will say when they are done) until `_FROZEN_KEEP` newer ones were."""

    def __init__(
        self, gather: Callable[[int], None], release: Callable[[int], None], runtimes: Sequence[GroupRuntime]
    ) -> None:
        self._gather = gather
        self._release = release
        self._runtimes = runtimes
        self.held: set[int] = set()
        self.frozen: list[int] = []
        self.current: list[int] = []
        """The groups of the module whose backward runs now."""
        self.keep: set[int] = set()
        """Groups of a leaf whose backward runs: never released for room ([Note: leaf modules])."""

    def gather(self, i: int) -> None:
        if i in self.held:
            return
        self._gather(i)
        self.held.add(i)
        if self._runtimes[i].n_req_grad == 0 and i not in self.keep:  # (a leaf's: held whole)
            # keep the last few, release older ones (a later use re-gathers on demand)
            self.frozen.append(i)
            while len(self.frozen) > _FROZEN_KEEP:
                self.release(self.frozen.pop(0))

    def release(self, i: int) -> None:
        if i in self.held:
            self.held.discard(i)
            if i in self.frozen:
                self.frozen.remove(i)
            self._release(i)

    def release_for_room(self, keep: int) -> bool:
        """Under live-budget pressure, release groups held for gradients that have not all
        arrived (tied or external weights) outside the current module; re-gathered on demand."""
        spare = [j for j in self.held if j != keep and j not in self.current and j not in self.keep]
        for j in spare:
            self.release(j)
        return bool(spare)

    def release_all(self) -> None:
        self.keep.clear()
        for i in list(self.held):
            self.release(i)


class PassState:
    """The bookkeeping of the running pass. See the module docstring."""

    def __init__(
        self,
        trace: Trace,
        runtimes: Sequence[GroupRuntime],
        holds: BackwardHolds,
        target: HookTarget,
        saved: SavedTensorRefs,
    ) -> None:
        self._trace = trace
        self._runtimes = runtimes
        self.holds = holds
        self._target = target
        self._saved = saved
        self.in_backward = False
        self.sealed: set[int] = set()
        """Groups handed to an overlapped optimizer step in this backward: gathering them again raises."""
        self._modes: list[Any] = []
        self.entered: set[int] = set()
        """ids of the modules whose forward ran in this pass (for CollectiveOrderError's advice)."""

    def begin(self) -> None:
        if self._trace.in_pass:
            self.end()  # a forward whose backward never came (eval, or loss discarded)
        self._trace.begin_pass()
        self.entered.clear()
        self.in_backward = False
        self.holds.current = []
        self.enter_modes()

    def end(self) -> None:
        self.holds.release_all()
        for rt in self._runtimes:
            if rt.evicting is not None:
                rt.wait_evicted()
        self.sealed.clear()
        self._trace.end_pass()

    def enter_modes(self) -> None:
        """The saved-tensor hooks (with grad) and ExternalParamMode, for the engine's forward.
        See [Note: saved tensors and external parameters]."""
        self.exit_modes()
        if not torch.is_grad_enabled():
            modes: list[Any] = [ExternalParamMode(self._target)]
        else:
            modes = [
                torch.autograd.graph.saved_tensors_hooks(self._saved.pack, self._saved.unpack),
                ExternalParamMode(self._target),
            ]
        for m in modes:
            m.__enter__()
            self._modes.append(m)

    def exit_modes(self) -> None:
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
