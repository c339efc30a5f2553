"""The conformance suite's new checks catch the breaks they are for (each fails on a broken backend).

Each broken backend differs from a correct in-memory one in exactly one rule of docs/backends.md.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from tiered.errors import StorageIOError, StorageKeyError
from tiered.storage import Capabilities, Capacity, StorageBackend, check_key, check_out_size, tensor_bytes
from tiered.testing import BackendConformance

_SHARED: dict[str, dict[str, bytes]] = {}  # "disk" shared by instances made on one tmp_path


class GoodBackend(StorageBackend):
    name = "catches-good"
    static_capabilities = Capabilities(persistent=True, memory_like=False)

    def __init__(self, where: str) -> None:
        self._data = _SHARED.setdefault(where, {})

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        self._data[check_key(key)] = tensor_bytes(tensor, what=key).numpy().tobytes()

    async def read(self, key: str, out: torch.Tensor) -> None:
        if check_key(key) not in self._data:
            raise StorageKeyError(f"key {key!r} not found")
        value = self._data[key]
        dst = tensor_bytes(out, what=key)
        check_out_size(key, len(value), dst.numel())
        if value:
            dst.copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))

    async def delete(self, key: str) -> None:
        if check_key(key) not in self._data:
            raise StorageKeyError(f"key {key!r} not found")
        del self._data[key]

    async def exists(self, key: str) -> bool:
        return check_key(key) in self._data

    def capacity(self) -> Capacity:
        return Capacity(None, None)


class LateReader(GoodBackend):
    """Fills `out` from a thread of its own that outlives a cancelled read."""

    async def read(self, key: str, out: torch.Tensor) -> None:
        value = self._data[check_key(key)]
        dst = tensor_bytes(out, what=key)
        done = asyncio.get_running_loop().create_future()

        def fill() -> None:
            time.sleep(0.02)
            dst.copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
            done.get_loop().call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=fill, daemon=True).start()
        await done


class TornWriter(GoodBackend):
    """Stores a write in two halves with a yield between: same-key writes interleave."""

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        raw = tensor_bytes(tensor, what=key).numpy().tobytes()
        old = self._data.get(check_key(key), b"")
        half = len(raw) // 2
        self._data[key] = raw[:half] + old[half : len(raw)].ljust(len(raw) - half, b"\0")
        await asyncio.sleep(0)
        self._data[key] = self._data[key][:half] + raw[half:]


class ZeroFillsShort(GoodBackend):
    """Keeps one file per key; a short file is padded with zeros instead of being an error."""

    def __init__(self, where: str) -> None:
        self.root = Path(where)
        self.root.mkdir(parents=True, exist_ok=True)

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        (self.root / check_key(key)).write_bytes(tensor_bytes(tensor, what=key).numpy().tobytes())

    async def read(self, key: str, out: torch.Tensor) -> None:
        f = self.root / check_key(key)
        if not f.exists():
            raise StorageKeyError(f"key {key!r} not found")
        dst = tensor_bytes(out, what=key)
        raw = f.read_bytes().ljust(dst.numel(), b"\0")
        if raw:
            dst.copy_(torch.frombuffer(bytearray(raw[: dst.numel()]), dtype=torch.uint8))


class ClaimsMemoryLike(GoodBackend):
    static_capabilities = Capabilities(persistent=True, memory_like=True)


class ClaimsPersistent(GoodBackend):
    """Declares persistent, but each instance has its own dict."""

    def __init__(self, where: str) -> None:
        self._data = {}


def _suite(cls: type[StorageBackend]) -> BackendConformance:
    class Suite(BackendConformance):
        timeout_s = 30.0

        def make_backend(self, tmp_path: Path) -> StorageBackend:
            return cls(str(tmp_path / "store"))

    return Suite()


@pytest.mark.parametrize("delay_s", [0.0, 0.002])
def test_cancelled_read_check_catches_a_late_writer(tmp_path: Path, delay_s: float) -> None:
    _suite(GoodBackend).test_cancelled_read_leaves_out_alone_once_it_returns(tmp_path / "g", delay_s)
    with pytest.raises(AssertionError, match="after it returned"):
        _suite(LateReader).test_cancelled_read_leaves_out_alone_once_it_returns(tmp_path / "b", delay_s)


def test_same_key_check_catches_torn_writes(tmp_path: Path) -> None:
    _suite(GoodBackend).test_same_key_concurrent_writes_and_reads(tmp_path / "g")
    with pytest.raises(AssertionError, match="mix"):
        _suite(TornWriter).test_same_key_concurrent_writes_and_reads(tmp_path / "b")


def test_truncation_check_catches_zero_filling(tmp_path: Path) -> None:
    class Correct(ZeroFillsShort):
        async def read(self, key: str, out: torch.Tensor) -> None:
            f = self.root / check_key(key)
            check_out_size(key, f.stat().st_size, out.nbytes)
            await super().read(key, out)

    _suite(Correct).test_truncated_object_is_an_error_not_data(tmp_path / "g")
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        _suite(ZeroFillsShort).test_truncated_object_is_an_error_not_data(tmp_path / "b")


def test_capability_check_catches_false_claims(tmp_path: Path) -> None:
    _suite(GoodBackend).test_declared_capabilities_hold(tmp_path / "g")
    with pytest.raises(NotImplementedError, match="not memory-like"):
        _suite(ClaimsMemoryLike).test_declared_capabilities_hold(tmp_path / "m")
    with pytest.raises(StorageKeyError, match="persists"):
        _suite(ClaimsPersistent).test_declared_capabilities_hold(tmp_path / "p")


def test_use_after_close_is_refused_for_every_backend_by_the_base_class(tmp_path: Path) -> None:
    # GoodBackend has no close() and no closed flag of its own: the contract's guard does it
    _suite(GoodBackend).test_use_after_close_is_an_error(tmp_path)

    async def main() -> None:
        b = GoodBackend(str(tmp_path / "x"))
        await b.write("k", torch.ones(2))
        await b.close()
        with pytest.raises(StorageIOError, match="catches-good.*closed"):
            await b.read("k", torch.empty(2))

    asyncio.run(main())


class OverConcurrent(GoodBackend):
    """Declares io_concurrency 2, but runs each write as 6 blocking calls at once, unbounded."""

    io_concurrency = 2

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        gate = threading.Barrier(6, timeout=5)  # all six really run at once
        await self.bridge.run_all([(gate.wait,) for _ in range(6)])
        await super().write(key, tensor)


class BadBouncePath(GoodBackend):
    """Declares 4096-byte alignment and reads a buffer off that boundary one byte late."""

    static_capabilities = Capabilities(persistent=True, memory_like=False, alignment_bytes=4096)

    async def read(self, key: str, out: torch.Tensor) -> None:
        await super().read(key, out)
        dst = tensor_bytes(out, what=key)
        if dst.data_ptr() % 4096 and dst.numel() > 1:
            dst[1:] = dst[:-1].clone()


class ForgetsOnClose(GoodBackend):
    """Declares persistent, but close() drops everything it held."""

    async def close(self) -> None:
        self._data.clear()


def test_alignment_check_catches_a_broken_unaligned_path(tmp_path: Path) -> None:
    _suite(GoodBackend).test_declared_alignment_holds(tmp_path / "g")
    with pytest.raises(AssertionError, match="past an 4096-byte boundary"):
        _suite(BadBouncePath).test_declared_alignment_holds(tmp_path / "b")


def test_concurrency_check_catches_more_calls_than_declared(tmp_path: Path) -> None:
    _suite(GoodBackend).test_declared_concurrency_holds(tmp_path / "g")
    with pytest.raises(
        AssertionError, match=r"io_concurrency 2 declared, but \d+ blocking calls ran at once"
    ):
        _suite(OverConcurrent).test_declared_concurrency_holds(tmp_path / "b")


def test_persistence_check_catches_bytes_lost_at_close(tmp_path: Path) -> None:
    _suite(GoodBackend).test_declared_persistence_survives_close_and_reopen(tmp_path / "g")
    with pytest.raises(StorageKeyError, match="survivor"):
        _suite(ForgetsOnClose).test_declared_persistence_survives_close_and_reopen(tmp_path / "b")
