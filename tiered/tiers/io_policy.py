"""How long one backend call may take, and which of its failures are tried again.

[Note: byte-scaled I/O timeouts]
One fixed timeout cannot fit every call: a 4 KiB read that has not returned in a minute is a hung
mount, while a 20 GiB write at a slow disk's 200 MB/s needs 100 s. So each backend call gets

    bound = min(timeout_s, io_timeout_floor_s + nbytes / io_min_bytes_per_s)

(defaults: floor 30 s, 50 MB/s, timeout_s 600 s): small calls fail fast, big ones get the time a
slow but working disk needs, and nothing waits past the manager's ``timeout_s``. A call that runs
out is cancelled (the await is; a syscall already on the bridge finishes in its thread, and its
result is dropped) and raises TierTimeoutError naming the operation, partition, tier, backend and
key, and the bound with how it was reached.

[Note: retries of transient errors]
A backend error whose errno is in the transient class (by default EAGAIN, EINTR, EBUSY, ETIMEDOUT
and EIO: a busy or briefly failing device) is tried again up to ``io_retries`` times, sleeping
``io_retry_backoff_s`` x 2^attempt (at most 1 s) between tries; only reads and whole-object
writes are retried, which are idempotent: a read changes nothing and a write replaces the whole
object with the same bytes. A timeout is never retried (the call may still be running). Every
retry, every recovery and every give-up is counted in the manager's stats (``io``); an error
that outlives its retries says how many were made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tiered.config.values import errno_codes

T = TypeVar("T")

DEFAULT_TRANSIENT = ("EAGAIN", "EINTR", "EBUSY", "ETIMEDOUT", "EIO")
_MAX_BACKOFF_S = 1.0


@dataclass(frozen=True)
class IOPolicy:
    """Timeout and retry rules for every backend call of one manager (see the Notes)."""

    timeout_s: float = 600.0
    floor_s: float = 30.0
    min_bytes_per_s: float = 50e6
    retries: int = 3
    backoff_s: float = 0.01
    transient: frozenset[int] = field(default_factory=lambda: errno_codes(DEFAULT_TRANSIENT, "io"))

    def __post_init__(self) -> None:
        for name in ("timeout_s", "floor_s", "min_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"IOPolicy.{name} must be > 0, got {getattr(self, name)!r}")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError(
                f"IOPolicy: retries and backoff_s must be >= 0, got {self.retries}, {self.backoff_s}"
            )

    def bound_s(self, nbytes: int) -> float:
        """[Note: byte-scaled I/O timeouts]."""
        return min(self.timeout_s, self.floor_s + max(0, nbytes) / self.min_bytes_per_s)

    def describe_bound(self, nbytes: int) -> str:
        b = self.bound_s(nbytes)
        if b >= self.timeout_s:
            return f"{b:g} s (tiered.timeout_s)"
        return (
            f"{b:.3g} s (tiered.io_timeout_floor_s {self.floor_s:g} s + {nbytes} B at "
            f"tiered.io_min_bytes_per_s {self.min_bytes_per_s:g})"
        )

    def is_transient(self, exc: BaseException) -> bool:
        """An OSError (anywhere on the cause chain) with a transient errno."""
        seen: BaseException | None = exc
        for _ in range(8):
            if seen is None:
                return False
            if isinstance(seen, OSError) and seen.errno in self.transient:
                return True
            seen = seen.__cause__
        return False


@dataclass
class IOCounters:
    """Retries and verification, counted on the loop thread; part of the manager's stats."""

    retries: int = 0
    recovered: int = 0
    gave_up: int = 0
    timeouts: int = 0
    verified_reads: int = 0
    verified_bytes: int = 0
    checksum_failures: int = 0
    truncated: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(vars(self))


async def with_retries(
    call: Callable[[], Awaitable[T]],
    policy: IOPolicy,
    counters: IOCounters,
    on_retry: Callable[[int, BaseException], None],
) -> T:
    """`call()` again after a transient error, at most `policy.retries` more times
    ([Note: retries of transient errors]); the last error, saying how many tries were made."""
    attempt = 0
    while True:
        try:
            out = await call()
        except OSError as exc:
            if not policy.is_transient(exc):
                raise
            if attempt >= policy.retries:
                if attempt:
                    counters.gave_up += 1
                exc._tiered_retries = attempt  # type: ignore[attr-defined]
                raise
            on_retry(attempt, exc)
            counters.retries += 1
            await asyncio.sleep(min(_MAX_BACKOFF_S, policy.backoff_s * (2**attempt)))
            attempt += 1
            continue
        if attempt:
            counters.recovered += 1
        return out
