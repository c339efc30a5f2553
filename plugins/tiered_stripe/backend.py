"""StripeBackend: RAID-0 over member backends (directories on several drives, or any specs).

See [Note: stripe layout] and [Note: stripe commit] in layout.py for where the bytes go and why a
write is atomic across members, and [Note: stripe scratch mode] for the in-place rewrite over
scratch members (the engine's swap files). One member is that member itself: every call goes straight
through with the caller's key, no stripe record, so its files are the member's own (a one-path
stripe set *is* an nvme backend on that path, memory-like members stay memory-like).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch

from tiered.errors import ConfigError, StorageIOError, StorageKeyError
from tiered.storage.base import (
    Capabilities,
    Capacity,
    StorageBackend,
    check_key,
    check_out_size,
    tensor_bytes,
)
from tiered.storage.bridge import IOBridge
from tiered.storage.nested import forwarded_options, open_nested
from tiered.storage.registry import spec_host_buffer_bytes
from tiered.units import parse_bytes
from tiered_stripe.layout import (
    PAGE_BYTES,
    RECORD_BYTES,
    StripeRecord,
    home_member,
    object_stripe_bytes,
    record_key,
    stripe_key,
    stripes,
)
from tiered_stripe.members import close_now, finish_all, run_all

log = logging.getLogger(__name__)

DEFAULT_STRIPE_BYTES = 1 << 20
_OWN_OPTIONS = ("members", "paths", "stripe_bytes", "member_options", "atomic")


def _is_scratch(member: StorageBackend) -> bool:
    """A member in a declared scratch mode (in-place writes, docs/backends.md): its spec says
    ``"atomic": false`` (the nvme backend's [Note: nvme scratch mode], the one such mode today)."""
    return member.spec().get("atomic") is False


def _member_specs(members: Any, paths: Any, member_options: Any) -> tuple[list[Any], str]:
    """The member specs and the spec key they came from ("members" or "paths"), validated."""
    if (members is None) == (paths is None):
        raise ConfigError(
            "backend 'stripe': give exactly one of 'members' (a list of backend specs) or 'paths' "
            "(a list of directories, one nvme member each)" + ("" if members is None else ", not both")
        )
    source = "members" if members is not None else "paths"
    items = members if members is not None else paths
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError(f"backend 'stripe': {source} must be a non-empty list, got {items!r}")
    if member_options is not None and source != "paths":
        raise ConfigError(
            "backend 'stripe': member_options applies to 'paths'; put options in each member spec"
        )
    if not isinstance(member_options, (dict, type(None))) or {"type", "path"} & set(member_options or {}):
        raise ConfigError(
            f"backend 'stripe': member_options must be a dict of nvme options without 'type' or 'path', got {member_options!r}"
        )
    if source == "paths":
        seen: dict[str, int] = {}
        for i, p in enumerate(items):
            if not isinstance(p, (str, os.PathLike)) or not os.fspath(p):
                raise ConfigError(f"backend 'stripe': paths[{i}] must be a directory path, got {p!r}")
            norm = os.path.realpath(os.path.expanduser(os.fspath(p)))
            if norm in seen:
                raise ConfigError(
                    f"backend 'stripe': paths[{seen[norm]}] and paths[{i}] are the same directory {norm!r}; "
                    "striping over one directory twice gains nothing - give each member its own drive"
                )
            seen[norm] = i
        return [{"type": "nvme", "path": os.fspath(p), **(member_options or {})} for p in items], source
    for i, spec in enumerate(items):
        for j in range(i):
            if isinstance(spec, dict) and spec == items[j]:
                raise ConfigError(
                    f"backend 'stripe': members[{j}] and members[{i}] are the same spec {spec!r}"
                )
    return list(items), source


class _KeyLocks:
    """One asyncio.Lock per key in use (dropped when unused): the ops on a key run one at a time."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class StripeBackend(StorageBackend):
    """``{"type": "stripe", "stripe_bytes": "1MiB", "members": [SPEC, ...]}`` or ``"paths": [DIR, ...]``."""

    name = "stripe"

    def __init__(
        self,
        members: Sequence[Any] | None = None,
        paths: Sequence[str] | None = None,
        stripe_bytes: int | str = DEFAULT_STRIPE_BYTES,
        member_options: dict[str, Any] | None = None,
        atomic: bool | None = None,
        **options: Any,
    ) -> None:
        if atomic is not None and not isinstance(atomic, bool):
            raise ConfigError(
                f"backend 'stripe': atomic must be true, false or left out (then it follows the members), got {atomic!r}"
            )
        self.stripe_bytes = parse_bytes(stripe_bytes, what="backend 'stripe' option 'stripe_bytes'")
        if self.stripe_bytes < 1:
            raise ConfigError(f"backend 'stripe': stripe_bytes must be at least 1 byte, got {stripe_bytes!r}")
        specs, self._source = _member_specs(members, paths, member_options)
        forward = forwarded_options(options, _OWN_OPTIONS, self.name)
        self._paths = [os.fspath(p) for p in paths] if paths is not None else None
        self._member_options = dict(member_options) if member_options else None
        opened: list[StorageBackend] = []
        try:
            for i, spec in enumerate(specs):
                opened.append(open_nested(spec, forward, where=f"backend 'stripe' {self._source}[{i}]"))
        except BaseException:
            close_now(opened)
            raise
        self.members: tuple[StorageBackend, ...] = tuple(opened)
        self._single = len(opened) == 1
        self._boundary = math.lcm(PAGE_BYTES, *(m.capabilities.alignment_bytes for m in opened))
        self._atomic_option = atomic
        self.atomic = atomic if atomic is not None else not all(_is_scratch(m) for m in opened)
        """False: rewrite an object in place when its layout is unchanged ([Note: stripe scratch mode])."""
        self._records: dict[str, StripeRecord] = {}  # this process is the only writer: a cache
        self._locks = _KeyLocks()
        self._closed = False

    @classmethod
    def host_buffer_bytes(cls, options: Mapping[str, Any]) -> int:
        """Each member's own buffers ([Note: one memory model]): every member is a backend of its own."""
        specs, _ = _member_specs(options.get("members"), options.get("paths"), options.get("member_options"))
        return sum(spec_host_buffer_bytes(spec) for spec in specs)

    # ---- description -------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        caps = [m.capabilities for m in self.members]
        if self._single:
            return caps[0]
        return Capabilities(
            persistent=all(c.persistent for c in caps),
            memory_like=False,  # a striped object is no one resident tensor
            alignment_bytes=math.lcm(*(c.alignment_bytes for c in caps)),
            direct_gpu=all(c.direct_gpu for c in caps),
        )

    def capacity(self) -> Capacity:
        """RAID-0: stripes spread evenly, so the smallest member bounds it: min x n."""
        caps = [m.capacity() for m in self.members]
        n = len(caps)
        totals = [c.total_bytes for c in caps if c.total_bytes is not None]
        frees = [c.free_bytes for c in caps if c.free_bytes is not None]
        return Capacity(
            total_bytes=min(totals) * n if len(totals) == n else None,
            free_bytes=min(frees) * n if len(frees) == n else None,
        )

    def use_bridge(self, bridge: IOBridge | None) -> None:
        """The members do the blocking calls: each gets the bridge too."""
        super().use_bridge(bridge)
        for m in self.members:
            m.use_bridge(bridge)

    def locate(self, key: str) -> str:
        if self._single:
            return self.members[0].locate(key)
        return f"stripes of key {key!r} over {len(self.members)} members (first on {self.members[0].locate(key)})"

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.name, "stripe_bytes": self.stripe_bytes}
        if self._paths is not None:
            out["paths"] = list(self._paths)
            if self._member_options:
                out["member_options"] = dict(self._member_options)
        else:
            out["members"] = [m.spec() for m in self.members]
        if self._atomic_option is not None:
            out["atomic"] = self._atomic_option
        return out

    def _describe(self, member: int) -> str:
        m = self.members[member]
        path = m.spec().get("path")
        return f"member {member} ({m.name!r}" + (f" at {path!r})" if isinstance(path, str) else ")")

    # ---- helpers -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StorageIOError("stripe backend is closed; open a new one with tiered.open_backend")

    async def _record(self, key: str, *, missing_ok: bool = False) -> StripeRecord | None:
        cached = self._records.get(key)
        if cached is not None:
            return cached
        home = home_member(key, len(self.members))
        buf = torch.empty(RECORD_BYTES, dtype=torch.uint8)
        where = f"stripe backend: key {key!r}, record {record_key(key)!r} on {self._describe(home)}"
        try:
            await self.members[home].read(record_key(key), buf)
        except StorageKeyError:
            if missing_ok:
                return None
            raise StorageKeyError(
                f"key {key!r} not found in stripe backend (no stripe record {record_key(key)!r} on "
                f"{self._describe(home)})"
            ) from None
        except ValueError as exc:
            raise StorageIOError(f"{where}: the record has the wrong size ({exc}); it is corrupt") from exc
        rec = StripeRecord.unpack(buf, where=where)
        if rec.members != len(self.members):
            raise StorageIOError(
                f"{where}: the object was striped over {rec.members} members but this backend has "
                f"{len(self.members)}; open it with the same member list it was written with"
            )
        self._records[key] = rec
        return rec

    def _context(self, exc: BaseException, what: str, *, reading: bool = False) -> BaseException:
        """`exc` with `what` (key, stripe, member) prefixed, keeping its type and errno."""
        if not isinstance(exc, Exception):
            return exc
        if reading and isinstance(
            exc, (StorageKeyError, ValueError)
        ):  # a stripe the record names is gone or short
            return StorageIOError(
                f"{what}: {exc}; the stripe set is inconsistent - restore it from a checkpoint"
            )
        try:
            new = type(exc)(f"{what}: {exc}")
        except Exception:  # noqa: BLE001 - an error type that cannot be rebuilt from a message is returned as it came
            return exc
        if isinstance(exc, OSError) and isinstance(new, OSError):
            new.errno = exc.errno
        return new

    async def _stripe_io(
        self, op: str, key: str, index: int, member: int, name: str, buf: torch.Tensor
    ) -> None:
        m = self.members[member]
        try:
            await (m.write(name, buf) if op == "write" else m.read(name, buf))
        except Exception as exc:
            err = self._context(
                exc,
                f"stripe backend: {op} of key {key!r} stripe {index} ({name!r}) on {self._describe(member)}",
                reading=op == "read",
            )
            if err is exc:
                raise
            raise err from exc

    async def _discard(self, key: str, rec: StripeRecord) -> None:
        """Delete one generation's stripes; what cannot be deleted stays as garbage, said once."""
        home = home_member(key, len(self.members))

        async def drop(index: int, member: int) -> None:
            name = stripe_key(key, rec.generation, index)
            try:
                await self.members[member].delete(name)
            except StorageKeyError:
                pass  # never written (a cancelled write) or already gone
            except Exception as exc:  # noqa: BLE001 - the data is safe either way; only space leaks
                log.warning(
                    "stripe backend: could not delete stale stripe %r on %s: %s",
                    name,
                    self._describe(member),
                    exc,
                )

        await run_all([drop(i, m) for i, m, _, _ in stripes(rec.nbytes, rec.stripe_bytes, rec.members, home)])

    # ---- contract ----------------------------------------------------------------------------
    async def write(self, key: str, tensor: torch.Tensor) -> None:
        self._check_open()
        if self._single:
            return await self.members[0].write(key, tensor)
        check_key(key)
        flat = tensor_bytes(tensor, what=f"stripe write of key {key!r}").detach()
        n, count = flat.numel(), len(self.members)
        home = home_member(key, count)
        async with self._locks.hold(key):
            try:
                old = await self._record(key, missing_ok=True)
            except StorageIOError as exc:  # a corrupt record is replaced by this write
                log.warning("%s; overwriting it", exc)
                old = None
            size = object_stripe_bytes(n, self.stripe_bytes, count, self._boundary)
            if not self.atomic and old is not None and old.holds(count, size, n):
                return await self._write_in_place(key, flat, old, home)
            rec = StripeRecord(count, size, n, secrets.randbits(63))
            try:
                await self._write_committed(key, flat, rec, home)
            finally:
                if old is not None and self._records.get(key) is rec:  # committed, even if cancelled
                    await self._discard(key, old)

    async def _write_in_place(self, key: str, flat: torch.Tensor, rec: StripeRecord, home: int) -> None:
        """Over the stripes of the generation the record names: [Note: stripe scratch mode]."""
        plan = stripes(rec.nbytes, rec.stripe_bytes, rec.members, home)
        try:
            await finish_all(
                [
                    self._stripe_io("write", key, i, m, stripe_key(key, rec.generation, i), flat[a:b])
                    for i, m, a, b in plan
                ]
            )
        except asyncio.CancelledError:
            raise  # finish_all ran every stripe write to its end: the new object is whole
        except BaseException:
            # some stripes hold the new bytes, some the old: drop the key rather than keep a mix
            self._records.pop(key, None)
            try:
                await self.members[home].delete(record_key(key))
            except StorageKeyError:
                pass
            except Exception as exc:  # noqa: BLE001 - the stripes go next: a read then finds one missing
                log.warning(
                    "stripe backend: could not delete the record of torn key %r on %s: %s",
                    key,
                    self._describe(home),
                    exc,
                )
            await self._discard(key, rec)
            raise

    async def _write_committed(self, key: str, flat: torch.Tensor, rec: StripeRecord, home: int) -> None:
        """Stripes first, then the record: [Note: stripe commit]."""
        plan = stripes(rec.nbytes, rec.stripe_bytes, rec.members, home)
        try:
            await run_all(
                [
                    self._stripe_io("write", key, i, m, stripe_key(key, rec.generation, i), flat[a:b])
                    for i, m, a, b in plan
                ]
            )
        except BaseException:
            await self._discard(key, rec)
            raise
        try:
            await self.members[home].write(record_key(key), rec.pack())
            self._records[key] = rec
        except BaseException as exc:
            # a member may finish an atomic write it was cancelled in: look before deleting anything
            self._records.pop(key, None)
            try:
                landed = await self._record(key, missing_ok=True)
            except Exception:  # noqa: BLE001 - cannot tell: keep the stripes (garbage at worst)
                self._records.pop(key, None)
                raise exc from None
            if landed is None or landed.generation != rec.generation:
                await self._discard(key, rec)
            else:
                self._records[key] = rec
            if isinstance(exc, Exception):
                err = self._context(
                    exc, f"stripe backend: write of key {key!r} record on {self._describe(home)}"
                )
                if err is not exc:
                    raise err from exc
            raise

    async def read(self, key: str, out: torch.Tensor) -> None:
        self._check_open()
        if self._single:
            return await self.members[0].read(key, out)
        check_key(key)
        dst = tensor_bytes(out, what=f"stripe read of key {key!r}").detach()
        async with self._locks.hold(key):
            rec = await self._record(key)
            assert rec is not None
            check_out_size(key, rec.nbytes, dst.numel(), where="stripe backend")
            home = home_member(key, rec.members)
            await run_all(
                [
                    self._stripe_io("read", key, i, m, stripe_key(key, rec.generation, i), dst[a:b])
                    for i, m, a, b in stripes(rec.nbytes, rec.stripe_bytes, rec.members, home)
                ]
            )

    async def delete(self, key: str) -> None:
        self._check_open()
        if self._single:
            return await self.members[0].delete(key)
        check_key(key)
        home = home_member(key, len(self.members))
        async with self._locks.hold(key):
            rec = await self._record(key)
            assert rec is not None
            self._records.pop(key, None)
            try:
                await self.members[home].delete(record_key(key))  # the commit point of a delete
            except StorageKeyError:
                raise StorageKeyError(f"key {key!r} not found in stripe backend") from None
            await self._discard(key, rec)

    async def exists(self, key: str) -> bool:
        self._check_open()
        if self._single:
            return await self.members[0].exists(key)
        check_key(key)
        if key in self._records:
            return True
        return await self.members[home_member(key, len(self.members))].exists(record_key(key))

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._single:
            return self.members[0].allocate(key, numel, dtype)
        return super().allocate(key, numel, dtype)

    def view(self, key: str) -> torch.Tensor:
        if self._single:
            return self.members[0].view(key)
        return super().view(key)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for m in self.members:  # every member, even after one failed
            try:
                await m.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        self._records.clear()
        if errors:
            raise errors[0]
