"""What was going on when a tier operation failed: the one helper that re-raises with context.

[Note: error context]
An error raised on the loop (a backend failing mid-read, a timeout) is re-raised in the training
thread by `TierFuture.result`. On the way, the first tier-layer frame that sees it prefixes what
was going on - operation, partition, tiers of the move, backend names, key - and marks it, so
outer frames do not prefix it again. The error keeps its type (a StorageKeyError stays a
KeyError, a backend's ValueError stays a ValueError) with the original as ``__cause__``; only
an exception type that cannot be rebuilt from a message becomes a StorageIOError.
"""

from __future__ import annotations

from typing import NoReturn

from tiered.errors import StorageIOError


def where(op: str, part_name: str, tier: str, backend: str) -> str:
    """The context of one operation on one copy: op, partition, tier, backend, key."""
    return f"{op} of partition {part_name!r} in tier {tier!r} (backend {backend!r}, key {part_name!r})"


def with_context(exc: BaseException, context: str) -> BaseException:
    """`exc` with `context` prefixed, keeping its type when possible; `exc` itself if it already
    carries context or is not an Exception (a cancel, an interrupt)."""
    if getattr(exc, "_tiers_context", False) or not isinstance(exc, Exception):
        return exc
    msg = f"{context}: {exc}"
    try:
        new = type(exc)(msg)
    except Exception:  # noqa: BLE001 - an error type that cannot be rebuilt from a message becomes a StorageIOError
        new = StorageIOError(msg)
    new.__cause__ = exc
    return mark(new)


def rethrow(err: BaseException, exc: BaseException) -> NoReturn:
    """Raise `err` (made by `with_context` from `exc`, which is being handled) from `exc`."""
    if err is exc:
        raise exc
    raise err from exc


def raise_in_context(exc: BaseException, context: str) -> NoReturn:
    """In an ``except`` block: re-raise `exc` with `context` (see the Note)."""
    rethrow(with_context(exc, context), exc)


def mark(exc: BaseException) -> BaseException:
    """`exc` already says everything: no frame above prefixes it again."""
    exc._tiers_context = True  # type: ignore[attr-defined]
    return exc
