"""Small backends for the tier-manager tests: a memory-like one and a disk-like one.

Both count the bytes they hold at every instant (``held_bytes``, ``max_held_bytes``), so a
test can check a budget against what the backend really held, not against the manager's own
bookkeeping, and both can be told to fail or stall on chosen keys.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import torch

from tiered.errors import StorageIOError, StorageKeyError
from tiered.storage.base import Capabilities, Capacity, StorageBackend, check_key, tensor_bytes
from tiered.tiers import Tier, TierManager


class _Faults:
    def __init__(self) -> None:
        self.fail_read: set[str] = set()
        self.fail_write: set[str] = set()
        self.delay_s: float = 0.0
        self.gate: asyncio.Event | None = None  # set by a test to hold every op until released
        self.inflight = 0
        self.max_inflight = 0
        self.lock = threading.Lock()

    async def enter(self, op: str, key: str) -> None:
        with self.lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if op == "read" and key in self.fail_read:
                raise StorageIOError(f"injected read failure for key {key!r}")
            if op == "write" and key in self.fail_write:
                raise StorageIOError(f"injected write failure for key {key!r}")
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        with self.lock:
            self.inflight -= 1


class MemBackend(StorageBackend):
    """Memory-like: resident CPU tensors by key (what the "gpu"/"cpu" tiers look like here)."""

    name = "test-mem"

    def __init__(self) -> None:
        self.store: dict[str, torch.Tensor] = {}
        self.faults = _Faults()
        self.held_bytes = 0
        self.max_held_bytes = 0
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(persistent=False, memory_like=True)

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        check_key(key)
        if key in self.store:
            raise ValueError(f"test-mem: key {key!r} allocated twice")
        t = torch.empty(numel, dtype=dtype)
        t.view(torch.uint8).fill_(0xA5)  # garbage, so a test notices a buffer that was never filled
        with self._lock:
            self.store[key] = t
            self.held_bytes += t.nbytes
            self.max_held_bytes = max(self.max_held_bytes, self.held_bytes)
        return t

    def view(self, key: str) -> torch.Tensor:
        try:
            return self.store[key]
        except KeyError:
            raise StorageKeyError(f"test-mem: no key {key!r}") from None

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        await self.faults.enter("write", key)
        try:
            if key not in self.store:
                self.allocate(key, tensor.numel(), tensor.dtype)
            self.store[key].copy_(tensor.reshape(-1))
        finally:
            self.faults.exit()

    async def read(self, key: str, out: torch.Tensor) -> None:
        await self.faults.enter("read", key)
        try:
            out.copy_(self.view(key).view(out.dtype).reshape(out.shape))
        finally:
            self.faults.exit()

    async def delete(self, key: str) -> None:
        with self._lock:
            t = self.store.pop(key, None)
            if t is None:
                raise StorageKeyError(f"test-mem: no key {key!r}")
            self.held_bytes -= t.nbytes

    async def exists(self, key: str) -> bool:
        return key in self.store

    def capacity(self) -> Capacity:
        return Capacity(None, None)


class DiskBackend(StorageBackend):
    """Disk-like: files in a directory, written atomically (persistent, not memory-like)."""

    name = "test-disk"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.faults = _Faults()
        self.held_bytes = 0
        self.max_held_bytes = 0
        self.sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(persistent=True, memory_like=False)

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        await self.faults.enter("write", key)
        try:
            data = tensor_bytes(tensor, what=f"test-disk write {key!r}").cpu().numpy().tobytes()
            tmp = self.path(key).with_suffix(".tmp")
            await asyncio.to_thread(tmp.write_bytes, data)
            os.replace(tmp, self.path(key))
            with self._lock:
                self.held_bytes += len(data) - self.sizes.get(key, 0)
                self.sizes[key] = len(data)
                self.max_held_bytes = max(self.max_held_bytes, self.held_bytes)
        finally:
            self.faults.exit()

    async def read(self, key: str, out: torch.Tensor) -> None:
        await self.faults.enter("read", key)
        try:
            p = self.path(key)
            if not p.exists():
                raise StorageKeyError(f"test-disk: no key {key!r} (file {p})")
            data = await asyncio.to_thread(p.read_bytes)
            if len(data) != out.nbytes:
                raise ValueError(f"test-disk: key {key!r} holds {len(data)} bytes, out has {out.nbytes}")
            tensor_bytes(out, what=f"test-disk read {key!r}").copy_(
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
            )
        finally:
            self.faults.exit()

    async def delete(self, key: str) -> None:
        p = self.path(key)
        if not p.exists():
            raise StorageKeyError(f"test-disk: no key {key!r}")
        p.unlink()
        with self._lock:
            self.held_bytes -= self.sizes.pop(key, 0)

    async def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def capacity(self) -> Capacity:
        return Capacity(None, None)


def three_tier_manager(
    tmp_path: Path,
    *,
    gpu_bytes: int | None = 4096,
    cpu_bytes: int | None = 16384,
    nvme_bytes: int | None = None,
    **kw: object,
) -> TierManager:
    """gpu (memory-like), cpu (memory-like), nvme (disk files under tmp_path), fastest first."""
    return TierManager(
        [
            Tier("gpu", MemBackend(), gpu_bytes),
            Tier("cpu", MemBackend(), cpu_bytes),
            Tier("nvme", DiskBackend(tmp_path / "nvme"), nvme_bytes),
        ],
        **kw,  # type: ignore[arg-type]
    )


def backend(mgr: TierManager, tier: str) -> MemBackend | DiskBackend:
    b = mgr.tier(tier).backend
    assert isinstance(b, (MemBackend, DiskBackend))
    return b
