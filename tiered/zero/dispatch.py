"""What the hooks dispatch to: forward enter/exit, backward gathers, passes, external
parameters and saved-tensor references. A mixin of ZeroParameters (all state lives there);
see [Note: hooks that only dispatch] and [Note: saved tensors and external parameters]."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiered.errors import ShapeMutationError
from tiered.zero.hooks import ExternalParamMode

if TYPE_CHECKING:
    from tiered.zero.params import ZeroParameters

_FROZEN_KEEP = 2
"""Frozen groups gathered in backward stay until this many newer ones were gathered."""


class DispatchMixin:
    """Hook targets of ZeroParameters."""

    def _groups_of(self: ZeroParameters, module: nn.Module) -> list[int]:
        mid = id(module)
        if self._module_params[mid] != tuple(id(p) for p in module.parameters(recurse=False)):
            raise ShapeMutationError(
                f"module {self._module_names[mid]!r} had a parameter replaced or added after tiered partitioned "
                "it: create all parameters before initialize and do not reassign them"
            )
        extra = self._extra_groups.get(mid)
        return self._module_groups[mid] + extra if extra else self._module_groups[mid]

    def _forward_enter(self: ZeroParameters, module: nn.Module) -> None:
        if module is self.model and not self._fw_stack:
            self._begin_pass()
        idxs = self._groups_of(module)
        for i in idxs:
            self._gather(i)
        self._fw_pins.setdefault(id(module), []).append(list(idxs))
        self._fw_stack.append(module)

    def _forward_exit(self: ZeroParameters, module: nn.Module) -> None:
        if self._fw_stack and self._fw_stack[-1] is module:
            self._fw_stack.pop()
        stack = self._fw_pins.get(id(module))
        if stack:
            for i in stack.pop():
                self._release(i)
        if module is self.model and not self._fw_stack:
            self._exit_modes()
            if not torch.is_grad_enabled():
                self._end_pass()  # no backward will follow

    def _begin_pass(self: ZeroParameters) -> None:
        if self.trace.in_pass:
            self._end_pass()  # a forward whose backward never came (eval, or loss discarded)
        self.trace.begin_pass()
        self._in_backward = False
        self._bw_current = []
        self._enter_modes()

    def _end_pass(self: ZeroParameters) -> None:
        for i in list(self._bw_held):
            self._bw_release(i)
        for i, st in enumerate(self._st):
            if st.evicting is not None:
                self._wait_evicted(i)
        self._sealed.clear()
        self.trace.end_pass()

    def _enter_modes(self: ZeroParameters) -> None:
        self._exit_modes()
        if not torch.is_grad_enabled():
            modes: list[Any] = [ExternalParamMode(self)]
        else:
            modes = [torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), ExternalParamMode(self)]
        for m in modes:
            m.__enter__()
            self._modes.append(m)

    def _exit_modes(self: ZeroParameters) -> None:
        while self._modes:
            self._modes.pop().__exit__(None, None, None)

    def _gather_external(self: ZeroParameters, p: nn.Parameter) -> None:
        """A parameter used by an op while not gathered. See [Note: saved tensors and external parameters]."""
        i, _ = self._managed[id(p)]
        self._counters["external_gathers"] += 1
        if self._fw_stack:
            mod = self._fw_stack[-1]
            extra = self._extra_groups.setdefault(id(mod), [])
            if i not in extra and i not in self._module_groups[id(mod)]:
                extra.append(i)
            self._gather(i)
            self._fw_pins[id(mod)][-1].append(i)
        else:  # outside any module: held until the pass ends
            self._bw_gather(i)

    def _backward_enter_cb(self: ZeroParameters, module: nn.Module) -> Callable[[], None]:
        def cb() -> None:
            self._in_backward = True
            idxs = self._groups_of(module)
            self._bw_current = idxs
            for i in idxs:
                self._bw_gather(i)
        return cb

    def _bw_gather(self: ZeroParameters, i: int) -> None:
        if i in self._bw_held:
            return
        self._gather(i)
        self._bw_held.add(i)
        if self._st[i].n_req_grad == 0:
            # no gradient will say when a frozen group is done: keep the last few, release older
            # ones (a later use re-gathers on demand)
            self._bw_frozen.append(i)
            while len(self._bw_frozen) > _FROZEN_KEEP:
                self._bw_release(self._bw_frozen.pop(0))

    def _release_bw_for_room(self: ZeroParameters, keep: int) -> bool:
        """Under live-budget pressure in backward, release groups held for gradients that have not
        all arrived (tied or external weights) outside the current module; re-gathered on demand."""
        spare = [j for j in self._bw_held if j != keep and j not in self._bw_current]
        for j in spare:
            self._bw_release(j)
        return bool(spare)

    def _bw_release(self: ZeroParameters, i: int) -> None:
        if i in self._bw_held:
            self._bw_held.discard(i)
            if i in self._bw_frozen:
                self._bw_frozen.remove(i)
            self._release(i)

    # saved tensors: see [Note: saved tensors and external parameters]
    def _pack(self: ZeroParameters, t: torch.Tensor) -> Any:
        ref = self._managed.get(id(t))
        if ref is not None:
            return ("p", ref[0], ref[1])
        if t.numel() == 0 or t.device != self.device:
            return t
        ptr = t.data_ptr()
        for i in self._gathered:  # few groups are gathered at once; scan those
            f = self._st[i].full
            if f is None or f.dtype != t.dtype:
                continue
            base = f.data_ptr()
            if base <= ptr < base + f.numel() * f.element_size() and f.untyped_storage().data_ptr() == \
                    t.untyped_storage().data_ptr():
                self._counters["saved_refs"] += 1
                return ("v", i, t.storage_offset() - f.storage_offset(), tuple(t.shape), t.stride())
        return t

    def _unpack(self: ZeroParameters, obj: Any) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        kind, i = obj[0], obj[1]
        st = self._st[i]
        if st.full is None:
            self._counters["backward_on_demand"] += 1
            self._bw_gather(i)
        if kind == "p":  # the values, not the Parameter: a later release must not empty them
            e = self.groups[i].entries[obj[2]]
            return st.full[e.offset : e.offset + e.numel].view(e.shape)
        f = st.full
        return f.as_strided(obj[3], obj[4], f.storage_offset() + obj[2])
