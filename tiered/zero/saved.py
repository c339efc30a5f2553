"""Saved-tensor references: autograd's saved views of gathered buffers, kept as (group, offset,
shape, stride) and rebuilt on unpack (see [Note: saved tensors and external parameters] in
tiered/zero/hooks.py); and the parameters saved by a recomputation in backward.

[Note: recomputed frozen parameters]
torch.utils.checkpoint's non-reentrant recomputation (Hugging Face gradient checkpointing) saves
each tensor its pack hook sees, detaching the ones that require grad and keeping the others, a
frozen Parameter among them (LoRA's base, a frozen norm weight), *as the object itself*. ZeRO-3's
release then points that Parameter's ``.data`` at the empty placeholder, so the recomputed value
has shape [0] and the checkpoint raises CheckpointError ("Recomputed values ... different
metadata"). While a module's forward runs inside backward, `RecomputeParams` sits above torch's
hook and hands it a detached alias of a managed parameter instead: what torch already does for a
trainable one. The alias holds the values the recomputation used, as the views autograd saves of
a linear's weight (``weight.t()``) already do there. The hooks are chained by hand (torch keeps
only the innermost pair active), through torch's ``_top_saved_tensors_default_hooks``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiered.zero.budget import LiveBudget
from tiered.zero.counters import ScheduleCounters
from tiered.zero.group import GroupRuntime
from tiered.zero.split import SplitParam

ParamRef = tuple[int, int]
"""A managed parameter saved by autograd: (group index, entry index)."""
ViewRef = tuple[int, int | torch.SymInt, tuple[int, ...], tuple[int, ...]]
"""A view of a gathered buffer: (group index, storage offset from the buffer's, shape, stride)."""


@dataclass(frozen=True)
class WholeRef:
    """A parameter in pieces, or a view of its whole buffer ([Note: fused parameters in pieces]
    in tiered/zero/split.py): rebuilt from its pieces, gathered again if they were released."""

    param: int
    """id of the parameter."""
    view: tuple[int | torch.SymInt, tuple[int, ...], tuple[int, ...]] | None
    """(storage offset from the buffer's, shape, stride), or None: the parameter's values."""


Saved = torch.Tensor | ParamRef | ViewRef | WholeRef
"""What `SavedTensorRefs.pack` keeps of a saved tensor: itself, or where it lies."""


class SavedTensorRefs:
    """The pack / unpack pair installed as ``saved_tensors_hooks`` during the engine's forward."""

    def __init__(
        self,
        runtimes: Sequence[GroupRuntime],
        managed: Mapping[int, tuple[int, int]],
        budget: LiveBudget,
        counters: ScheduleCounters,
        device: torch.device,
        regather: Callable[[int], None],
        splits: Mapping[int, SplitParam],
    ) -> None:
        self._splits = splits
        self._runtimes = runtimes
        self._managed = managed
        self._budget = budget
        self._counters = counters
        self._device = device
        self._regather = regather  # gather a released group again, held for this backward

    def pack(self, t: torch.Tensor) -> Saved:
        ref = self._managed.get(id(t))
        if ref is not None:
            return WholeRef(id(t), None) if id(t) in self._splits else (ref[0], ref[1])
        if t.numel() == 0 or t.device != self._device:
            return t
        ptr = t.data_ptr()
        for pid, sp in self._splits.items():  # a view of a parameter put together from its pieces
            b = sp.buffer
            if b is not None and b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                self._counters.count_saved_ref()
                return WholeRef(pid, (t.storage_offset() - b.storage_offset(), tuple(t.shape), t.stride()))
        for i in self._budget.gathered:  # few groups are gathered at once; scan those
            f = self._runtimes[i].full
            if f is None or f.dtype != t.dtype:
                continue
            base = f.data_ptr()
            if (
                base <= ptr < base + f.numel() * f.element_size()
                and f.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            ):
                self._counters.count_saved_ref()
                return (i, t.storage_offset() - f.storage_offset(), tuple(t.shape), t.stride())
        return t

    def unpack(self, obj: Saved) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, WholeRef):
            sp = self._splits[obj.param]
            for i in sp.groups:
                if self._runtimes[i].full is None:
                    self._counters.count_backward_on_demand()
                    self._regather(i)
            b = sp.buffer
            assert b is not None
            if obj.view is None:  # the values, not the Parameter: a later release must not empty them
                return b.view(sp.shape)
            offset, shape, stride = obj.view
            return b.as_strided(shape, stride, b.storage_offset() + offset)
        i = obj[0]
        rt = self._runtimes[i]
        if rt.full is None:
            self._counters.count_backward_on_demand()
            self._regather(i)
        full = rt.full
        assert full is not None
        if len(obj) == 2:  # the values, not the Parameter: a later release must not empty them
            e = rt.group.entries[obj[1]]
            return full[e.offset : e.offset + e.numel].view(e.shape)
        _, offset, shape, stride = obj
        return full.as_strided(shape, stride, full.storage_offset() + offset)


class RecomputeParams:
    """Saved-tensor hooks for a module's forward run again inside backward (torch's
    non-reentrant checkpoint recomputation). See [Note: recomputed frozen parameters]."""

    def __init__(self, managed: Mapping[int, tuple[int, int]]) -> None:
        self._managed = managed
        self._stack: list[Any] = []

    def enter(self) -> None:
        """Push the hooks, chained to those below (torch's recomputation hook, if any)."""
        below = torch._C._autograd._top_saved_tensors_default_hooks(False)
        managed = self._managed

        def pack(t: torch.Tensor) -> Any:
            if id(t) in managed:
                t = t.detach()  # an alias of today's values, not the Parameter whose .data will change
            return below[0](t) if below is not None else t

        def unpack(obj: Any) -> torch.Tensor:
            return below[1](obj) if below is not None else obj

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._stack.append(hooks)

    def exit(self) -> None:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)
