"""Saved-tensor references: autograd's saved views of gathered buffers, kept as (group, offset,
shape, stride) and rebuilt on unpack. See [Note: saved tensors and external parameters] in
tiered/zero/hooks.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tiered.zero.budget import LiveBudget
from tiered.zero.group import GroupRuntime


class SavedTensorRefs:
    """The pack / unpack pair installed as ``saved_tensors_hooks`` during the engine's forward."""

    def __init__(
        self,
        runtimes: Sequence[GroupRuntime],
        managed: Mapping[int, tuple[int, int]],
        budget: LiveBudget,
        counters: dict[str, int],
        device: torch.device,
        regather: Callable[[int], None],
    ) -> None:
        self._runtimes = runtimes
        self._managed = managed
        self._budget = budget
        self._counters = counters
        self._device = device
        self._regather = regather  # gather a released group again, held for this backward

    def pack(self, t: torch.Tensor) -> Any:
        ref = self._managed.get(id(t))
        if ref is not None:
            return ("p", ref[0], ref[1])
        if t.numel() == 0 or t.device != self._device:
            return t
        ptr = t.data_ptr()
        for i in self._budget.gathered:  # few groups are gathered at once; scan those
            f = self._runtimes[i].full
            if f is None or f.dtype != t.dtype:
                continue
            base = f.data_ptr()
            if (
                base <= ptr < base + f.numel() * f.element_size()
                and f.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            ):
                self._counters["saved_refs"] += 1
                return ("v", i, t.storage_offset() - f.storage_offset(), tuple(t.shape), t.stride())
        return t

    def unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        kind, i = obj[0], obj[1]
        rt = self._runtimes[i]
        if rt.full is None:
            self._counters["backward_on_demand"] += 1
            self._regather(i)
        full = rt.full
        assert full is not None
        if kind == "p":  # the values, not the Parameter: a later release must not empty them
            e = rt.group.entries[obj[2]]
            return full[e.offset : e.offset + e.numel].view(e.shape)
        return full.as_strided(obj[3], obj[4], full.storage_offset() + obj[2])
