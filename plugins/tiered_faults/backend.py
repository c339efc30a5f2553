"""FaultsBackend: any backend, opened from a nested spec, with faults injected on its operations.

[Note: injected faults look like real ones]
The point is that the engine meets exactly what a failing disk gives it, so every injected error
is what the storage contract says a backend raises: a `StorageIOError` (an OSError) whose
``errno`` is the one asked for (EIO, EAGAIN, ENOSPC, ...), with a message naming the wrapped
backend, the operation, its count, the key and the rule. An injected error is raised *before*
the wrapped backend is called, so the old copy is intact, as after a failed atomic write. The
faults that break the contract on purpose say so: a torn write replaces the stored object with a
prefix (cut at a ``sector_bytes`` boundary, as a file opened with O_TRUNC holds after a write died
part way) and then fails, or, in ``mode: "silent"``, returns as if all was well (a lost tail, as a
disk that acknowledged a write it never finished); a ``bitflip`` on ``op: "write"`` stores a
corrupted copy (every later read sees it, the caller's tensor is untouched), on ``op: "read"`` it
corrupts only what that read returns. A ``hang`` waits until the operation is cancelled (a
timeout) or the backend is closed; ``close()`` fails every hung operation with a StorageIOError.

The wrapper is never memory-like (``allocate``/``view`` raise): a resident tensor handed out by a
memory-like inner backend would bypass read and write, and so every fault.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import logging
import os
import random
from collections import Counter, deque
from typing import Any

import torch

from tiered.errors import ConfigError, StorageIOError
from tiered.storage.base import Capacity, StorageBackend, check_key, tensor_bytes
from tiered.storage.nested import WrappingBackend
from tiered_faults.rules import FAULT_KINDS, OPS, FaultRule, parse_faults

log = logging.getLogger(__name__)

HISTORY_LENGTH = 1000


class _RuleState:
    """A rule's counters and random generator. See [Note: fault triggers] in rules.py."""

    def __init__(self, rule: FaultRule, index: int, seed: int) -> None:
        self.rule = rule
        self.index = index
        self.rng = random.Random(f"tiered-faults:{seed}:{index}")
        self.matched = 0
        self.fired = 0
        self.injected = 0
        self.used_bytes = 0  # enospc: bytes written or stored through the keys it matches

    def fire(self, op: str, key: str) -> bool:
        r = self.rule
        if not r.matches(op, key):
            return False
        self.matched += 1
        k = self.matched - r.after
        if k <= 0 or (r.max_fires is not None and self.fired >= r.max_fires):
            return False
        if r.nth is not None:
            hit = k in r.nth
        elif r.every is not None:
            hit = k % r.every == 0
        elif r.probability is not None:
            hit = self.rng.random() < r.probability
        else:
            hit = True
        self.fired += hit
        return hit

    def json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.rule.kind,
            "matched": self.matched,
            "fired": self.fired,
            "injected": self.injected,
        }


class FaultsBackend(WrappingBackend):
    """``{"type": "faults", "inner": SPEC, "faults": [RULE, ...], "seed": 0}``.

    See [Note: injected faults look like real ones] and, in rules.py, [Note: fault triggers].
    """

    name = "faults"
    own_options = ("inner", "faults", "seed")

    def __init__(
        self, inner: dict[str, Any] | str | StorageBackend, faults: Any = None, seed: int = 0, **options: Any
    ) -> None:
        self.rules = parse_faults(faults)  # validated before the inner backend opens: nothing to undo
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"backend 'faults': seed must be an integer, got {seed!r}")
        self.seed = seed
        self._states = [_RuleState(r, i, seed) for i, r in enumerate(self.rules)]
        self._sizes: dict[str, int] = {}
        self._hung: set[asyncio.Future[None]] = set()
        self._ops: Counter[str] = Counter()
        self._injected: Counter[str] = Counter()
        self._bytes = {"read": 0, "written": 0}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LENGTH)
        """The last injected faults: rule index, kind, op, key, what was done."""
        self._closed = False
        self.open_inner(inner, options)

    # ---- description -------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        cap = self.inner.capacity()
        total, free = cap.total_bytes, cap.free_bytes
        for st in self._states:  # a "stored" budget on every key is a smaller disk: say so
            r = st.rule
            if r.kind == "enospc" and r.count == "stored" and r.key is None:
                left = max(0, r.after_bytes - st.used_bytes)
                total = r.after_bytes if total is None else min(total, r.after_bytes)
                free = left if free is None else min(free, left)
        return Capacity(total_bytes=total, free_bytes=free)

    def stored_bytes(self, nbytes: int) -> int:
        return self.inner.stored_bytes(nbytes)

    def spec(self) -> dict[str, Any]:
        return {**super().spec(), "faults": [r.to_json() for r in self.rules], "seed": self.seed}

    def stats(self) -> dict[str, Any]:
        """Operations seen, faults injected per kind, per-rule counters, bytes moved."""
        return {
            "ops": {op: self._ops[op] for op in OPS},
            "injected": {kind: self._injected[kind] for kind in FAULT_KINDS},
            "injected_total": sum(self._injected.values()),
            "rules": [st.json() for st in self._states],
            "bytes_read": self._bytes["read"],
            "bytes_written": self._bytes["written"],
        }

    # ---- injection ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StorageIOError(f"faults backend over {self.inner.name!r} is closed; open a new one")

    def _start(self, op: str, key: str) -> list[_RuleState]:
        self._check_open()
        check_key(key)
        self._ops[op] += 1
        return [st for st in self._states if st.rule.kind != "enospc" and st.fire(op, key)]

    def _record(self, st: _RuleState, op: str, key: str, detail: str) -> None:
        st.injected += 1
        self._injected[st.rule.kind] += 1
        self.history.append({"rule": st.index, "kind": st.rule.kind, "op": op, "key": key, "detail": detail})
        log.debug("faults: %s on %s of %r: %s", st.rule.describe(st.index), op, key, detail)

    def _error(self, code: int, st: _RuleState, op: str, key: str, what: str = "") -> StorageIOError:
        name = errno_mod.errorcode.get(code, str(code))
        return StorageIOError(
            code,
            f"faults backend over {self.inner.name!r}: injected {name} ({os.strerror(code)}) on {op} "
            f"#{st.matched} of key {key!r} by {st.rule.describe(st.index)}{what}",
        )

    async def _before(self, fired: list[_RuleState], op: str, key: str) -> None:
        """Delays, hangs and errors: everything that happens before the inner backend is called."""
        delays = [st for st in fired if st.rule.kind == "delay"]
        for st in delays:
            self._record(st, op, key, f"delayed {st.rule.delay_s} s")
        if delays:
            await asyncio.sleep(sum(st.rule.delay_s for st in delays))
        for st in fired:
            if st.rule.kind == "hang":
                self._record(st, op, key, "hung until cancelled or closed")
                await self._hang(st, op, key)
        for st in fired:
            if st.rule.kind == "error":
                self._record(st, op, key, f"raised {errno_mod.errorcode.get(st.rule.errno)}")
                raise self._error(st.rule.errno, st, op, key)

    async def _hang(self, st: _RuleState, op: str, key: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hung.add(fut)
        try:
            await fut  # only close() resolves it; a cancel (a timeout) ends it too
        except StorageIOError as exc:
            raise StorageIOError(
                errno_mod.EIO, f"{op} of key {key!r} hung by {st.rule.describe(st.index)}: {exc}"
            ) from None
        finally:
            self._hung.discard(fut)

    def _flip(self, st: _RuleState, flat: torch.Tensor, op: str, key: str) -> None:
        r, n = st.rule, flat.numel()
        if r.offset is not None:
            if r.offset >= n:
                return  # fired, not injected: stats() tells them apart
            positions = [(r.offset, r.bit)]
        else:
            if n == 0:
                return
            positions = [(p // 8, p % 8) for p in sorted(st.rng.sample(range(n * 8), min(r.bits, n * 8)))]
        for byte, bit in positions:
            flat[byte] ^= 1 << bit
        where = "stored copy" if op == "write" else "data read"
        self._record(st, op, key, f"flipped {where} bit(s) " + ", ".join(f"{b}:{i}" for b, i in positions))

    def _check_space(self, key: str, nbytes: int) -> None:
        for st in self._states:
            r = st.rule
            if r.kind != "enospc" or not r.matches("write", key):
                continue
            st.matched += 1
            after = st.used_bytes + nbytes - (self._sizes.get(key, 0) if r.count == "stored" else 0)
            if after > r.after_bytes:
                st.fired += 1
                self._record(st, "write", key, f"ENOSPC at {st.used_bytes} of {r.after_bytes} bytes")
                raise self._error(
                    errno_mod.ENOSPC,
                    st,
                    "write",
                    key,
                    f": {nbytes} more bytes do not fit, {st.used_bytes} of its {r.after_bytes} bytes "
                    f"{r.count}; free space (delete keys) or raise after_bytes",
                )

    def _stored(self, key: str, nbytes: int | None) -> None:
        """Account a completed write (`nbytes` stored) or delete (None) for the enospc rules."""
        old = self._sizes.pop(key, 0)
        if nbytes is not None:
            self._sizes[key] = nbytes
            self._bytes["written"] += nbytes
        for st in self._states:
            r = st.rule
            if r.kind == "enospc" and r.matches("write", key):
                if r.count == "stored":
                    st.used_bytes += (nbytes or 0) - old
                elif nbytes is not None:
                    st.used_bytes += nbytes

    # ---- contract ----------------------------------------------------------------------------
    async def write(self, key: str, tensor: torch.Tensor) -> None:
        fired = self._start("write", key)
        flat = tensor_bytes(tensor, what=f"faults write of key {key!r}")
        await self._before(fired, "write", key)
        self._check_space(key, flat.numel())
        data = tensor
        for st in fired:
            if st.rule.kind == "bitflip":
                if data is tensor:
                    data = tensor.detach().clone()  # the caller's tensor stays as it was
                self._flip(st, tensor_bytes(data, what="bitflip"), "write", key)
        torn = next((st for st in fired if st.rule.kind == "torn_write"), None)
        n = flat.numel()
        if torn is not None and n > 0:
            await self._tear(torn, key, tensor_bytes(data, what="torn write"))
            return
        await self.inner.write(key, data)
        self._stored(key, n)

    async def _tear(self, st: _RuleState, key: str, flat: torch.Tensor) -> None:
        r, n = st.rule, flat.numel()
        keep = r.keep_bytes if r.keep_bytes is not None else int(n * r.keep_fraction)
        keep = min(keep, n - 1) // r.sector_bytes * r.sector_bytes  # a tear loses something, at a sector
        await self.inner.write(key, flat[:keep])
        self._stored(key, keep)
        self._record(st, "write", key, f"stored {keep} of {n} bytes ({r.mode})")
        if r.mode == "error":
            raise self._error(
                r.errno,
                st,
                "write",
                key,
                f": torn write, {keep} of {n} bytes reached the store and the previous copy is gone",
            )

    async def read(self, key: str, out: torch.Tensor) -> None:
        fired = self._start("read", key)
        await self._before(fired, "read", key)
        await self.inner.read(key, out)
        self._bytes["read"] += out.nbytes
        for st in fired:
            if st.rule.kind == "bitflip":
                self._flip(st, tensor_bytes(out, what="bitflip"), "read", key)

    async def delete(self, key: str) -> None:
        fired = self._start("delete", key)
        await self._before(fired, "delete", key)
        await self.inner.delete(key)
        self._stored(key, None)

    async def exists(self, key: str) -> bool:
        fired = self._start("exists", key)
        await self._before(fired, "exists", key)
        return await self.inner.exists(key)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fut in list(self._hung):
            err = StorageIOError(f"faults backend over {self.inner.name!r} was closed")
            try:
                fut.get_loop().call_soon_threadsafe(_fail, fut, err)
            except RuntimeError:  # its loop is closed: nothing waits on it any more
                pass
        try:
            for st in self._states:
                if st.rule.kind == "hang" and st.fire("close", ""):
                    self._record(st, "close", "", "hung until cancelled")
                    await asyncio.get_running_loop().create_future()  # only a cancel ends it
        finally:
            await super().close()  # the inner backend is closed even so


def _fail(fut: asyncio.Future[None], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


__all__ = ["FaultsBackend"]
