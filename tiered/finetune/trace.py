"""`tiered finetune --trace`: module compute spans added to the tier manager's trace of moves.

[Note: compute spans]
The tier manager already records every move as a Chrome-trace event (tiered/tiers/trace.py,
enabled by `tiered.trace_path`) and the offloaded Adam records one span per group; this adds
the compute. Per block (each element of an nn.ModuleList, i.e. the decoder layers, plus the
input and output embeddings) a forward pre-hook and a forward hook, installed after the
engine's own hooks, time the forward: the pre-hook runs after the engine gathered the block's
parameters, so a span is compute, not the wait for data. Backward is timed by tensor hooks,
which add no autograd node (an extra node changes the order in which gradients are summed; see
[Note: hooks that only dispatch]): the span of a block runs from the moment the gradient of its
output is complete to the moment the gradient of its input is. Everything is installed only
when tracing, so the default run pays nothing; `remove()` takes the hooks off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def traced_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules timed by `ComputeTracer`: every element of an nn.ModuleList (outermost lists
    only) and the input/output embeddings of a Hugging Face model, in model order."""
    found: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, mod in model.named_modules():
        if id(mod) in inside:
            continue
        if isinstance(mod, nn.ModuleList):
            for i, child in enumerate(mod):
                found.append((f"{name}.{i}" if name else str(i), child))
                inside.update(id(m) for m in child.modules())
    named = {id(m): n for n, m in model.named_modules()}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        emb = fn() if callable(fn) else None
        if isinstance(emb, nn.Module) and id(emb) in named and id(emb) not in inside:
            found.append((named[id(emb)], emb))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(found, key=lambda nm: order[nm[0]])


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for x in obj:
            t = _first_tensor(x)
            if t is not None:
                return t
    if isinstance(obj, dict):
        for x in obj.values():
            t = _first_tensor(x)
            if t is not None:
                return t
    return None


class ComputeTracer:
    """Forward and backward spans per block into `recorder` ([Note: compute spans])."""

    TRACK = "compute"

    def __init__(self, model: nn.Module, recorder: Any) -> None:
        self._rec = recorder
        self._handles: list[RemovableHandle] = []
        # per block: the forward start, and the backward box of the forward call in flight
        self._fwd_start: dict[str, float] = {}
        self._open: dict[str, list[float] | None] = {}
        for name, mod in traced_blocks(model):
            self._handles.append(mod.register_forward_pre_hook(self._pre(name)))
            # prepend: run before the engine's post-hook releases the parameters
            self._handles.append(mod.register_forward_hook(self._post(name), prepend=True))

    def _pre(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pre(mod: nn.Module, args: tuple[Any, ...]) -> None:
            box: list[float] | None = None
            x = _first_tensor(args)
            if x is not None and x.requires_grad and torch.is_grad_enabled():
                box = []
                x.register_hook(lambda g: self._bwd_end(name, box))
            self._open[name] = box
            self._fwd_start[name] = time.perf_counter()

        return pre

    def _post(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def post(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            t1 = time.perf_counter()
            t0 = self._fwd_start.pop(name, t1)
            self._rec.record_span(f"forward {name}", self.TRACK, t0, t1)
            box = self._open.pop(name, None)
            y = _first_tensor(output)
            if box is not None and y is not None and y.requires_grad:
                y.register_hook(lambda g: box.append(time.perf_counter()))

        return post

    def _bwd_end(self, name: str, box: list[float]) -> None:
        t1 = time.perf_counter()
        if box:
            self._rec.record_span(f"backward {name}", self.TRACK, box.pop(), t1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
