"""The storage backend contract: the one way bytes reach a tier.

[Note: backend contract]
A backend stores the raw bytes of contiguous tensors under string keys. The abstract core is
small and async: ``write``, ``read`` (into a caller-given tensor: no hidden copy), ``delete``,
``exists``, ``capacity``, ``close`` plus a ``capabilities`` record. Everything else (batched
helpers, key checks) is derived once here, so a third-party backend implements six methods.

Memory-like backends (``capabilities.memory_like``: GPU memory, pinned host memory) also hand out
the resident tensor itself through ``allocate`` and ``view``, so the tier manager can read a file
straight into the buffer the compute will use, and the compute can use it with no copy. Backends
that are not memory-like raise NotImplementedError there.

Writes are atomic per key: a reader never sees a half-written object, and a failed or cancelled
write leaves the previous good copy (if any) in place. The full rule book (errors, same-key
concurrency, cancellation, short objects, capabilities) is docs/backends.md.

Use after close is enforced here, for every backend: a subclass's ``write`` and ``read`` are
wrapped at class creation (`__init_subclass__`) to raise StorageIOError once its ``close`` ran,
so no backend hands out bytes from, or writes into, a store it has already released.

Blocking calls (``os.open``, ``pwritev``, ``fsync``, ``unlink``, a large host memcpy) never run on
the event loop: a backend sends them through ``self.bridge``, the `IOBridge` it was handed
([Note: one I/O bridge] in `tiered.storage.bridge`), and owns no thread pool of its own::

    class MyBackend(StorageBackend):
        async def delete(self, key):
            await self.bridge.run(os.unlink, self._file(key))   # bounded, off the loop

        async def write(self, key, tensor):
            ...
            await self.bridge.run_all([(self._write_chunk, fd, buf, off) for off in offsets])

A backend that bounds its own share passes ``limiter=`` (a `CapacityLimiter`) and declares it as
``io_concurrency``. The tier manager hands every tier's backend its bridge (`use_bridge`) before
the first move, sized ``io_threads`` plus the backends' ``io_concurrency``;
``tiered.open_backend(spec, bridge=b)`` does the same, and a backend opened directly uses
`default_bridge()`. ``bridge.executor`` is the pool itself for a library that takes an executor.
"""

from __future__ import annotations

import abc
import functools
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from tiered.errors import StorageIOError, StorageKeyError, StoredSizeError
from tiered.storage.bridge import IOBridge, default_bridge

_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class Capabilities:
    """What a backend is, so the tier manager can plan moves without isinstance checks."""

    persistent: bool
    """Bytes survive the process (files, object stores)."""
    memory_like: bool
    """Resident bytes are addressable as a tensor: ``allocate`` / ``view`` work."""
    alignment_bytes: int = 1
    """Buffers handed to read/write perform best (or must be) aligned to this many bytes."""
    direct_gpu: bool = False
    """``read``/``write`` accept CUDA tensors directly (GPU memory, GPUDirect Storage)."""
    device: str = "cpu"
    """Where a memory-like backend's resident tensors live ("cpu", "cuda:0")."""
    max_concurrency: int = 0
    """Requests (reads and writes) this backend takes at once at most: the tier manager keeps no
    more moves than this in flight on any link to or from its tier. 0: no limit of its own."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LocalFile:
    """Where a key's stored bytes are for `StorageBackend.local_file`: bytes
    [offset, offset + nbytes) of the plain local file `path`."""

    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Capacity:
    """Bytes a backend can hold; None where it cannot tell (an object store)."""

    total_bytes: int | None
    free_bytes: int | None


MAX_KEY_CHARS = 200
"""Longest key every backend takes: a file name is at most 255 bytes, and file backends add a
suffix of their own (a temporary name, a stripe index), so a longer key is refused in every
backend alike, not by one filesystem's ENAMETOOLONG."""


def check_key(key: str) -> str:
    """Keys are flat names: letters, digits, '_', '-', '.'; never '/', '..' or empty; at most
    `MAX_KEY_CHARS` characters.

    Raises StorageKeyError naming the key, so a key can never escape a backend's directory.
    """
    if not isinstance(key, str) or not key or key in (".", "..") or ".." in key or not _KEY_RE.match(key):
        raise StorageKeyError(
            f"invalid storage key {key!r}: use letters, digits, '_', '-' and '.' only "
            "(no '/', no '..', not empty)"
        )
    if len(key) > MAX_KEY_CHARS:
        raise StorageKeyError(
            f"invalid storage key {key[:40]!r}... ({len(key)} characters): keys are at most "
            f"{MAX_KEY_CHARS} characters in every backend; use a shorter name"
        )
    return key


def tensor_bytes(t: torch.Tensor, *, what: str) -> torch.Tensor:
    """A contiguous tensor viewed as flat uint8, or a ValueError naming `what`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def check_out_size(key: str, stored_nbytes: int, out_nbytes: int, *, where: str = "") -> None:
    """ValueError naming the key and both sizes when a read target has the wrong size."""
    if stored_nbytes != out_nbytes:
        at = f" ({where})" if where else ""
        raise StoredSizeError(
            f"read of key {key!r}{at}: stored object has {stored_nbytes} bytes but the output tensor "
            f"has {out_nbytes} bytes; pass a tensor of exactly {stored_nbytes} bytes (or, if the "
            f"object was written with {out_nbytes} bytes, it was truncated: it is corrupt)",
            stored_nbytes,
            out_nbytes,
        )


def _refuse_after_close(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def guarded(self: StorageBackend, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_contract_closed"):
            raise StorageIOError(
                f"storage backend {self.name!r} ({type(self).__name__}) is closed; "
                "open a new one with tiered.open_backend(spec)"
            )
        return await fn(self, *args, **kwargs)

    guarded._tiered_close_guard = True  # type: ignore[attr-defined]  # wrap once per function
    return guarded


def _mark_closed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def closing(self: StorageBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(self, *args, **kwargs)
        finally:
            self.__dict__["_contract_closed"] = True

    closing._tiered_close_guard = True  # type: ignore[attr-defined]
    return closing


class StorageBackend(abc.ABC):
    """Abstract core of a storage backend. See [Note: backend contract]."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # use after close (see the Note): guard each write/read/close a subclass defines itself
        super().__init_subclass__(**kwargs)
        for attr, wrap in (
            ("write", _refuse_after_close),
            ("read", _refuse_after_close),
            ("close", _mark_closed),
        ):
            fn = cls.__dict__.get(attr)
            if inspect.iscoroutinefunction(fn) and not getattr(fn, "_tiered_close_guard", False):
                setattr(cls, attr, wrap(fn))

    name: ClassVar[str] = "abstract"
    """Registry name, e.g. "nvme"."""
    install_hint: ClassVar[str] = ""
    """What to install if this backend's import fails, shown in BackendImportError."""
    static_capabilities: ClassVar[Capabilities | None] = None
    """Capabilities known without constructing the backend (shown by ``tiered backends``)."""
    io_concurrency: int = 0
    """Blocking calls this backend runs on its bridge at once at most (its own `CapacityLimiter`);
    a tier manager widens its bridge by this much, so the backend's share never starves the
    manager's own copies. 0: no calls of its own, or no bound declared."""

    @classmethod
    def host_buffer_bytes(cls, options: Mapping[str, Any]) -> int:
        """Host memory a backend opened with `options` (its spec less "type") holds of its own at
        most (bounce buffers, staging), outside what it stores; the memory model counts it
        ([Note: one memory model], tiered/planning/needs.py). A classmethod, so a plan needs no
        backend opened. 0: none, or only transient per-call buffers."""
        return 0

    @property
    def capabilities(self) -> Capabilities:
        """This instance's capabilities: ``static_capabilities`` unless a backend whose answer
        depends on its arguments (a device, a kvstore driver) overrides this property."""
        if self.static_capabilities is None:
            raise NotImplementedError(
                f"backend {type(self).__name__}: set the class attribute static_capabilities "
                "or override the capabilities property"
            )
        return self.static_capabilities

    @abc.abstractmethod
    async def write(self, key: str, tensor: torch.Tensor) -> None:
        """Store the bytes of contiguous `tensor` under `key`, atomically replacing any old copy."""

    @abc.abstractmethod
    async def read(self, key: str, out: torch.Tensor) -> None:
        """Fill contiguous `out` with the bytes stored under `key`.

        Raises StorageKeyError if the key is missing and ValueError if ``out.nbytes`` differs
        from the stored size.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove `key`; StorageKeyError if it does not exist."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def capacity(self) -> Capacity: ...

    def stored_bytes(self, nbytes: int) -> int:
        """Bytes of ``capacity().free_bytes`` that storing a value of `nbytes` takes (a file
        backend rounds up to its filesystem's blocks); the engine's free-space check sums it."""
        return nbytes

    # ---- the I/O bridge (see the Note) ------------------------------------------------------
    @property
    def bridge(self) -> IOBridge:
        """The bridge this backend's blocking calls go through: the one handed in, else the default."""
        bridge = getattr(self, "_io_bridge", None)
        return bridge if bridge is not None and not bridge.closed else default_bridge()

    def use_bridge(self, bridge: IOBridge | None) -> None:
        """Send this backend's blocking calls through `bridge` from now on (None: the default)."""
        if bridge is not None and not isinstance(bridge, IOBridge):
            raise TypeError(
                f"backend {self.name!r}: use_bridge expects a tiered.storage.IOBridge, got {bridge!r}"
            )
        self._io_bridge = bridge

    def release_cached(self) -> None:
        """Give back memory the backend keeps for reuse after a delete (a buffer pool's free
        lists); buffers in use stay. Called where deleted bytes must leave the process, not wait
        for a reuse ([Note: restore at close group by group]). Default: nothing is cached."""
        return

    async def close(self) -> None:
        """Release files, threads and memory. Idempotent. (Overrides need not call this: the
        close guard marks them closed too, see the Note.)"""
        self.__dict__["_contract_closed"] = True

    # ---- memory-like backends only (see the Note) ------------------------------------------
    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Reserve a resident tensor for `key` (contents undefined) and return it."""
        raise NotImplementedError(f"backend {self.name!r} is not memory-like: it has no resident tensors")

    def view(self, key: str) -> torch.Tensor:
        """The resident tensor stored under `key` (no copy)."""
        raise NotImplementedError(f"backend {self.name!r} is not memory-like: it has no resident tensors")

    # ---- derived helpers -------------------------------------------------------------------
    def locate(self, key: str) -> str:
        """Where `key`'s bytes live, for error messages: a file path for file backends."""
        return f"key {key!r} of backend {self.name!r}"

    def local_file(self, key: str) -> LocalFile | None:
        """Optional: where `key`'s stored bytes lie in a plain local file (`LocalFile`: the
        bytes [offset, offset + nbytes) of `path`; the file may hold padding or other keys
        around them), for a caller's own reads while no operation of this backend on `key`
        runs; None (the default) where a key is not stored so. A backend that returns one also
        implements `adopt_file`. Checkpoints use both to copy large objects in bounded chunks."""
        return None

    async def adopt_file(self, key: str, path: str) -> None:
        """Make the complete plain file `path` (in the directory of ``local_file(key).path``,
        holding exactly the new bytes) `key`'s stored object, atomically: afterwards reads return
        its bytes, and on failure the previous object stays whole. The file becomes the
        backend's (renamed into place); a persistent backend makes it durable first. Called while
        no other operation on `key` runs; only on backends whose `local_file` returns one."""
        raise NotImplementedError(f"backend {self.name!r} stores no key as a local file (local_file is None)")

    def spec(self) -> dict[str, Any]:
        """A JSON-able spec that `tiered.open_backend` turns back into an equivalent backend."""
        return {"type": self.name}

    async def __aenter__(self) -> StorageBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()})"
