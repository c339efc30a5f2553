"""An engine's lifetime over its module: the marker that says which open engine manages a module
(set when the engine is built, removed at close: a second `initialize` over the module is refused,
and tiered.deepspeed's module-level API finds a parameter's engine), the optimizer's write-backs
waited for (a full disk said as such), and the parts closed in order at `Engine.close`."""

from __future__ import annotations

import errno
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiered.engine.persistence import refuse_use_while_empty
from tiered.errors import AlreadyManagedError, StorageIOError

if TYPE_CHECKING:
    from tiered.engine.parts import EngineParts
    from tiered.engine.persistence import EnginePersistence
    from tiered.optim.offload import OffloadedAdam

log = logging.getLogger(__name__)

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


def _is_enospc(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__
    return False


def wait_writes(optimizer: OffloadedAdam, what: str) -> None:
    """The optimizer's write-backs in flight end; a full disk among their errors gets the way
    out said ([Note: a failed write-back is retried by flush]); `what` is the call to repeat."""
    try:
        optimizer.wait_writes()
    except OSError as e:
        if not _is_enospc(e):
            raise
        raise StorageIOError(
            errno.ENOSPC,
            f"{e}. The disk is full; nothing is lost: the updated values stay in memory. Free "
            f"space there, call engine.flush() (it writes them home), then call {what} again",
        ) from e


@dataclass(frozen=True)
class Closed:
    """How `close_parts` went: whether the weights came back, and the errors to raise now that
    everything is closed."""

    restored: bool
    flush_error: Exception | None
    close_error: Exception | None

    def finish(self, module: torch.nn.Module) -> None:
        if not self.restored:
            refuse_use_while_empty(module)
        if self.flush_error is not None:  # raised once the engine is closed all the same
            raise self.flush_error from self.close_error
        if self.close_error is not None:
            raise self.close_error


def close_parts(parts: EngineParts, persistence: EnginePersistence, *, restore_weights: bool) -> Closed:
    """The optimizer (its write-backs), the persistent tiers flushed, the hooks removed, the
    weights given back (`restore_weights`, [Note: restore at close group by group]), the trace
    written, the tier manager closed: each step runs whatever the one before raised."""
    restored = False
    flushed = False
    flush_error: Exception | None = None
    close_error: Exception | None = None
    try:
        parts.optimizer.close()
        flush_error = persistence.flush_persistent_tiers()
        flushed = True
    finally:
        try:
            parts.zero.remove_hooks()
            if restore_weights and flushed:
                restored = persistence.restore_weights(flushed=flush_error is None)
        finally:
            trace_path = parts.config.tiered.trace_path
            if trace_path:
                try:
                    parts.tm.write_trace(trace_path)
                except Exception:
                    log.exception("could not write the trace to %s", trace_path)
            try:
                parts.tm.close()
            except Exception as e:  # noqa: BLE001 - a backend that would not close: raised by finish, once the weights are back
                close_error = e
    return Closed(restored, flush_error, close_error)
