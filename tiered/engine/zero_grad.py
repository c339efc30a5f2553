"""The model's own ``zero_grad``, redirected to the engine (and, through `shadow`, a client
optimizer's ``zero_grad`` / ``step``: tiered/deepspeed/client.py).

[Note: zero_grad of the model]
Under tiered a parameter's ``.grad`` stays None: its gradient is accumulated in its shard group's
fp32 partition on a tier. ``nn.Module.zero_grad`` and ``torch.optim.Optimizer.zero_grad`` clear
``.grad`` only, so in a script that calls ``model.zero_grad()`` (DeepSpeed's GAN example calls
the discriminator module's) the gradients a second backward put into the model (the generator's
loss through the discriminator) would stay accumulated and leak into the next step: silently
wrong training. So for the engine's lifetime the managed model's ``zero_grad`` is the engine's
(``engine.zero_grad()``); a submodule holding trainable parameters refuses ``zero_grad`` (its
gradients share shard groups with the rest: tiered cannot drop part of them), naming the call to
make. A client optimizer passed to tiered.deepspeed's initialize is replaced by the engine's: its
``zero_grad`` is the engine's and its ``step`` is the facade's (a no-op after ``engine.step()``,
an error otherwise), so a script still holding it cannot step nothing. All of it is undone at
close.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch


class _Engine(Protocol):
    """What the redirect needs of the engine (typed here: engine.py imports this module)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...


_MISSING = object()


def shadow(obj: Any, name: str, fn: Callable[..., Any], undo: list[Callable[[], None]]) -> None:
    """Set `obj.name` on the instance (over its class's method); `undo` restores what was there."""
    before = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = fn

    def restore() -> None:
        if obj.__dict__.get(name) is fn:
            if before is _MISSING:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = before

    undo.append(restore)


def redirect_zero_grad(module: torch.nn.Module, engine: _Engine) -> Callable[[], None]:
    """See [Note: zero_grad of the model]; returns the undo."""
    ref = weakref.ref(engine)
    undo: list[Callable[[], None]] = []

    def engine_zero_grad(set_to_none: bool = True) -> None:
        e = ref()
        if e is not None:
            e.zero_grad(set_to_none)

    shadow(module, "zero_grad", engine_zero_grad, undo)
    for name, sub in module.named_modules():
        if sub is module or not any(p.requires_grad for p in sub.parameters(recurse=True)):
            continue

        def refuse(set_to_none: bool = True, _name: str = name) -> None:
            raise RuntimeError(
                f"{_name}.zero_grad(): under tiered the gradients of {_name}'s parameters are accumulated in "
                "shard groups with the rest of the model's, which cannot be dropped in part; call "
                "engine.zero_grad() (or the whole model's zero_grad()) to drop all of them"
            )

        shadow(sub, "zero_grad", refuse, undo)

    def undo_all() -> None:
        for f in reversed(undo):
            f()

    return undo_all
