"""Which open engine manages a module: a marker on the module (weak, removed at close), so a
second `initialize` over it is refused and tiered.deepspeed's module-level API finds a
parameter's engine."""

from __future__ import annotations

import weakref

import torch

from tiered.errors import AlreadyManagedError

_MANAGED_ATTR = "_tiered_engine"


def check_not_managed(model: torch.nn.Module) -> None:
    """AlreadyManagedError when an open engine already manages `model`: two engines over one
    module would share its hooks and parameters, and the second would silently train nothing."""
    ref = model.__dict__.get(_MANAGED_ATTR)
    first = ref() if ref is not None else None
    if first is not None and not getattr(first, "_closed", True):
        raise AlreadyManagedError(
            f"tiered.initialize: module {type(model).__name__} is already managed by engine "
            f"{first!r} (id {id(first):#x}); use that engine, or call its close() first"
        )


_MANAGED_MODELS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Every model marked managed (weakly): the module-level DeepSpeed API finds a parameter's engine."""


def mark_managed(model: torch.nn.Module, engine: object) -> None:
    model.__dict__[_MANAGED_ATTR] = weakref.ref(engine)
    _MANAGED_MODELS.add(model)


def managed_models() -> list[tuple[torch.nn.Module, object]]:
    """(model, its open engine) for every model an engine manages now."""
    out = []
    for model in list(_MANAGED_MODELS):
        ref = model.__dict__.get(_MANAGED_ATTR)
        engine = ref() if ref is not None else None
        if engine is not None and not getattr(engine, "_closed", True):
            out.append((model, engine))
    return out


def unmark_managed(model: torch.nn.Module, engine: object) -> None:
    """`engine` closed: the module is an ordinary one again. The marker goes, so that nothing
    of tiered's is left on it (a weak reference would break ``torch.save(model)`` and
    ``copy.deepcopy``); a marker of a later engine stays."""
    ref = model.__dict__.get(_MANAGED_ATTR)
    if ref is not None and ref() in (engine, None):
        del model.__dict__[_MANAGED_ATTR]
