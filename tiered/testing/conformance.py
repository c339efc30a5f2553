"""The backend conformance suite: subclass `BackendConformance`, give it a backend, run pytest.

Example — a third-party backend in five lines::

    from tiered.testing import BackendConformance
    from my_pkg import RamDiskBackend

    class TestRamDisk(BackendConformance):
        def make_backend(self, tmp_path):          # may also be `async def`
            return RamDiskBackend(root=tmp_path)

[Note: conformance without an event-loop plugin]
Every test is a plain synchronous pytest function that runs its scenario with ``asyncio.run``: the
backend is made, used and closed inside that one loop. So the suite runs under any pytest
configuration (with or without pytest-asyncio), and a backend that binds loop-affine resources at
construction still works. Each scenario is bounded by `timeout_s`, so a hanging backend fails
instead of stalling the run.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from tiered.errors import StorageIOError, StorageKeyError
from tiered.storage.base import Capabilities, Capacity, LocalFile, StorageBackend
from tiered.storage.bridge import IOBridge, default_bridge
from tiered.storage.files import temp_path
from tiered.testing.capabilities import CapabilityChecks
from tiered.testing.data import random_bytes

T = TypeVar("T")

INVALID_KEYS = ["", "a/b", "/abs", "..", "../escape", "a..b", ".", "sp ace", "nul\x00", "back\\slash", "ünï"]
UNALIGNED_SIZES = [1, 3, 4095, 4096, 4097, (1 << 20) + 1, (3 << 20) + 5]


def _all_cpu_dtypes() -> list[torch.dtype]:
    """Every dtype torch can allocate on the CPU and view as bytes (float8 variants included)."""
    found: dict[str, torch.dtype] = {}
    for name in sorted(dir(torch)):
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype) or str(dt) in found or "q" in str(dt).split(".")[-1][:2]:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                torch.empty(4, dtype=dt).view(torch.uint8)
        except (RuntimeError, TypeError, NotImplementedError):
            continue  # bit/packed types (bits8, uint1...) have no byte view on the CPU
        found[str(dt)] = dt
    return [found[k] for k in sorted(found)]


ALL_DTYPES = _all_cpu_dtypes()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    numel = math.prod(shape)
    if dtype == torch.bool:
        return (random_bytes(numel, seed) % 2).bool().view(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return random_bytes(numel * itemsize, seed).view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def unaligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor whose first byte is deliberately not 8-byte (nor page) aligned."""
    return torch.empty(nbytes + 1, dtype=torch.uint8)[1:]


class BackendConformance(CapabilityChecks):
    """Behaviour every StorageBackend must show. Subclass and define `make_backend`.

    See the module docstring for an example and [Note: conformance without an event-loop plugin].
    Class attributes tune the suite for a backend: `timeout_s` bounds each scenario,
    `check_spec_roundtrip` reopens ``backend.spec()`` through `tiered.open_backend` (needs the
    backend registered).
    """

    timeout_s: float = 120.0
    check_spec_roundtrip: bool = True
    atomic_writes: bool = True
    """False for a scratch mode that overwrites in place (nvme ``atomic=False``, swap files): the
    same-key check then asks only that the next write after a burst is whole (docs/backends.md)."""

    def truncate_stored(self, tmp_path: Path, key: str) -> bool:
        """Cut the stored bytes of `key` to half, behind the backend's back; False if there is no
        file to cut. The default truncates every file under `tmp_path` whose name contains the
        key (one file per key, or one per stripe); a backend that hashes or packs its keys
        overrides this to damage its own layout."""
        found = False
        for f in sorted(tmp_path.rglob("*")):
            if f.is_file() and key in f.name:
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
                found = True
        return found

    def make_backend(self, tmp_path: Path) -> StorageBackend | Awaitable[StorageBackend]:
        raise NotImplementedError("subclasses of BackendConformance define make_backend(self, tmp_path)")

    # ---- harness ----------------------------------------------------------------------------
    def run(self, tmp_path: Path, scenario: Callable[[StorageBackend], Awaitable[T]]) -> T:
        async def main() -> T:
            made = self.make_backend(tmp_path)
            backend = await made if inspect.isawaitable(made) else made
            assert isinstance(backend, StorageBackend), f"make_backend returned {backend!r}"
            try:
                return await asyncio.wait_for(scenario(backend), timeout=self.timeout_s)
            finally:
                await backend.close()

        return asyncio.run(main())

    @staticmethod
    async def roundtrip(
        backend: StorageBackend, key: str, t: torch.Tensor, out: torch.Tensor | None = None
    ) -> None:
        await backend.write(key, t)
        if out is None:
            out = torch.empty_like(t)
        await backend.read(key, out)
        assert torch.equal(as_bytes(out), as_bytes(t)), f"key {key!r}: bytes differ after round trip"

    # ---- round trips ------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
    def test_roundtrip_every_dtype(self, tmp_path: Path, dtype: torch.dtype) -> None:
        async def scenario(b: StorageBackend) -> None:
            for i, shape in enumerate([(1,), (3, 5, 7), (1237,)]):
                await self.roundtrip(b, f"t{i}", random_tensor(shape, dtype, seed=i))

        self.run(tmp_path, scenario)

    @pytest.mark.parametrize("nbytes", UNALIGNED_SIZES)
    def test_roundtrip_sizes(self, tmp_path: Path, nbytes: int) -> None:
        async def scenario(b: StorageBackend) -> None:
            t = random_bytes(nbytes, seed=nbytes)
            await self.roundtrip(b, "sized", t)
            out = unaligned_empty(nbytes)  # a caller buffer with no alignment at all
            await b.read("sized", out)
            assert torch.equal(out, t), f"{nbytes} bytes: unaligned read differs"
            await self.roundtrip(b, "sized.unaligned-src", out)  # and an unaligned source

        self.run(tmp_path, scenario)

    def test_roundtrip_empty_tensor(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            await self.roundtrip(b, "empty", torch.empty(0, dtype=torch.float32))
            assert await b.exists("empty")

        self.run(tmp_path, scenario)

    def test_roundtrip_64mib(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            t = random_bytes(64 << 20, seed=64).view(torch.float32)
            await self.roundtrip(b, "big", t)

        self.run(tmp_path, scenario)

    def test_64_concurrent_operations(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            data = {f"c{i:02d}": random_bytes(1000 + 4099 * i, seed=100 + i) for i in range(64)}
            await asyncio.gather(*(b.write(k, v) for k, v in data.items()))
            outs = {k: torch.empty_like(v) for k, v in data.items()}
            await asyncio.gather(*(b.read(k, outs[k]) for k in data))
            for k, v in data.items():
                assert torch.equal(outs[k], v), f"key {k!r} differs after concurrent round trip"
            mixed = [
                b.write(k, torch.flip(v, [0])) if i % 2 else b.read(k, outs[k])
                for i, (k, v) in enumerate(data.items())
            ]
            await asyncio.gather(*mixed)
            for i, (k, v) in enumerate(data.items()):
                out = torch.empty_like(v)
                await b.read(k, out)
                assert torch.equal(out, torch.flip(v, [0]) if i % 2 else v), (
                    f"key {k!r} wrong after mixed ops"
                )

        self.run(tmp_path, scenario)

    # ---- overwrite / delete / missing -------------------------------------------------------
    def test_overwrite_with_different_size(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            await self.roundtrip(b, "ow", random_bytes(5000, seed=1))
            bigger = random_bytes(70_001, seed=2)
            await self.roundtrip(b, "ow", bigger)
            smaller = random_bytes(17, seed=3).view(torch.uint8)
            await self.roundtrip(b, "ow", smaller)
            with pytest.raises(ValueError):
                await b.read("ow", torch.empty(70_001, dtype=torch.uint8))

        self.run(tmp_path, scenario)

    def test_delete(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            await b.write("gone", random_bytes(10_000, seed=4))
            await b.write("kept", random_bytes(100, seed=5))
            assert await b.exists("gone")
            await b.delete("gone")
            assert not await b.exists("gone")
            assert await b.exists("kept"), "deleting one key removed another"
            with pytest.raises(StorageKeyError, match="gone"):
                await b.read("gone", torch.empty(10_000, dtype=torch.uint8))
            with pytest.raises(StorageKeyError, match="gone"):
                await b.delete("gone")
            await self.roundtrip(b, "gone", random_bytes(3, seed=6))  # the key is reusable

        self.run(tmp_path, scenario)

    def test_missing_key(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            assert not await b.exists("never-written")
            with pytest.raises(KeyError, match="never-written") as info:
                await b.read("never-written", torch.empty(8, dtype=torch.uint8))
            assert isinstance(info.value, StorageKeyError)

        self.run(tmp_path, scenario)

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_keys_rejected(self, tmp_path: Path, key: str) -> None:
        async def scenario(b: StorageBackend) -> None:
            t = torch.zeros(4, dtype=torch.uint8)
            for op in (
                lambda: b.write(key, t),
                lambda: b.read(key, t),
                lambda: b.delete(key),
                lambda: b.exists(key),
            ):
                with pytest.raises(StorageKeyError, match="invalid storage key"):
                    await op()

        self.run(tmp_path, scenario)
        assert not any(p.name.endswith("escape") for p in tmp_path.parent.iterdir()), (
            "a key escaped its directory"
        )

    def test_read_into_wrong_size_is_value_error(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            await b.write("sz", torch.arange(10, dtype=torch.float32))
            for wrong in (torch.empty(9, dtype=torch.float32), torch.empty(41, dtype=torch.uint8)):
                with pytest.raises(ValueError, match=r"sz.*40.*" + str(wrong.nbytes)):
                    await b.read("sz", wrong)

        self.run(tmp_path, scenario)

    def test_non_contiguous_input_rejected(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            with pytest.raises(ValueError, match="contiguous"):
                await b.write("nc", torch.arange(12.0).view(3, 4).t())

        self.run(tmp_path, scenario)

    # ---- cancellation -----------------------------------------------------------------------
    @pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.02])
    def test_cancelled_write_leaves_no_partial_object(self, tmp_path: Path, delay_s: float) -> None:
        async def scenario(b: StorageBackend) -> None:
            old = random_bytes(8 << 20, seed=7)
            new = random_bytes(8 << 20, seed=8)
            await b.write("victim", old)
            for key in ("victim", "fresh"):
                task = asyncio.ensure_future(b.write(key, new))
                await asyncio.sleep(delay_s)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if key == "fresh" and not await b.exists(key):
                    continue
                out = torch.empty_like(new)
                await b.read(key, out)
                is_old, is_new = torch.equal(out, old), torch.equal(out, new)
                assert is_new or (is_old and key == "victim"), f"key {key!r}: a partial object is visible"
            await self.roundtrip(b, "victim", random_bytes(100, seed=9))  # still usable afterwards

        self.run(tmp_path, scenario)

    @pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.02])
    def test_cancelled_read_leaves_out_alone_once_it_returns(self, tmp_path: Path, delay_s: float) -> None:
        """docs/backends.md: a cancelled read may have filled part of `out`, but never writes
        into it after the cancelled call returned (the caller reuses the buffer at once)."""

        async def scenario(b: StorageBackend) -> None:
            data = random_bytes(16 << 20, seed=31)
            await b.write("cread", data)
            for _ in range(3):
                out = torch.zeros_like(data)
                task = asyncio.ensure_future(b.read("cread", out))
                await asyncio.sleep(delay_s)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                seen = out.clone()
                for _ in range(5):  # let any straggling thread run: it must not touch `out`
                    await asyncio.sleep(0.01)
                assert torch.equal(out, seen), "a cancelled read wrote into `out` after it returned"
            out = torch.empty_like(data)
            await b.read("cread", out)  # the backend and the object are intact
            assert torch.equal(out, data)

        self.run(tmp_path, scenario)

    # ---- same-key concurrency ---------------------------------------------------------------
    def test_same_key_concurrent_writes_and_reads(self, tmp_path: Path) -> None:
        """Writes of one key at once leave one of them whole; a read beside them returns one whole
        version (the old one or a new one), never a mix."""

        async def scenario(b: StorageBackend) -> None:
            n = 2 << 20
            versions = [random_bytes(n, seed=40 + i) for i in range(6)]
            if not self.atomic_writes:  # scratch mode: no promise during the burst, only after it
                await asyncio.gather(*(b.write("hot", v) for v in versions))
                await self.roundtrip(b, "hot", random_bytes(3000, seed=49))
                return
            await b.write("hot", versions[0])
            outs = [torch.empty(n, dtype=torch.uint8) for _ in range(6)]
            ops = [b.write("hot", v) for v in versions[1:]] + [b.read("hot", o) for o in outs]
            await asyncio.gather(*ops)
            for i, o in enumerate(outs):
                assert any(torch.equal(o, v) for v in versions), f"read {i} beside writes returned a mix"
            final = torch.empty(n, dtype=torch.uint8)
            await b.read("hot", final)
            assert any(torch.equal(final, v) for v in versions[1:]), "same-key writes left a mix"
            sized = [random_bytes(1000 * (i + 1), seed=50 + i) for i in range(4)]
            await asyncio.gather(*(b.write("hot", v) for v in sized))
            whole = False
            for v in sized:
                try:
                    out = torch.empty_like(v)
                    await b.read("hot", out)
                except ValueError:
                    continue  # another size won: the right ValueError, nothing half-written
                whole = whole or torch.equal(out, v)
            assert whole, "writes of different sizes to one key left no whole version"

        self.run(tmp_path, scenario)

    # ---- short and corrupt objects -----------------------------------------------------------
    def test_truncated_object_is_an_error_not_data(self, tmp_path: Path) -> None:
        """A stored object cut short behind the backend's back reads as an error naming the key
        (StorageIOError, or the ValueError giving both sizes), never as success."""

        async def scenario(b: StorageBackend) -> None:
            if not b.capabilities.persistent:
                return  # nothing outside the process holds its bytes: nothing to truncate
            data = random_bytes(1 << 20, seed=60)
            await b.write("cutshort", data)
            await b.close()  # let everything reach the medium first
            if not self.truncate_stored(tmp_path, "cutshort"):
                pytest.skip(
                    f"{type(b).__name__} keeps no file named after the key under tmp_path; "
                    "override truncate_stored to check truncated objects"
                )
            reopened = await self._reopen(b, tmp_path)
            try:
                out = torch.zeros_like(data)
                with pytest.raises((StorageIOError, ValueError), match="cutshort"):
                    await reopened.read("cutshort", out)
            finally:
                await reopened.close()

        self.run(tmp_path, scenario)

    async def _reopen(self, b: StorageBackend, tmp_path: Path) -> StorageBackend:
        made = self.make_backend(tmp_path)
        again = await made if inspect.isawaitable(made) else made
        assert isinstance(again, StorageBackend)
        return again

    # ---- use after close --------------------------------------------------------------------
    def test_use_after_close_is_an_error(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            await b.write("late", random_bytes(100, seed=70))
            await b.close()
            with pytest.raises(StorageIOError, match="closed"):
                await b.write("late", random_bytes(100, seed=71))
            with pytest.raises(StorageIOError, match="closed"):
                await b.read("late", torch.empty(100, dtype=torch.uint8))
            await b.close()  # still idempotent

        self.run(tmp_path, scenario)

    # ---- declared capabilities hold ---------------------------------------------------------
    def test_declared_capabilities_hold(self, tmp_path: Path) -> None:
        """What `capabilities` declares is true of the backend (the tier manager plans by it)."""

        async def scenario(b: StorageBackend) -> None:
            caps = b.capabilities
            align = caps.alignment_bytes
            assert isinstance(align, int) and align >= 1 and align & (align - 1) == 0, (
                f"alignment_bytes must be a power of two, got {align!r}"
            )
            conc = getattr(b, "io_concurrency", 0)
            assert isinstance(conc, int) and conc >= 0, f"io_concurrency must be an int >= 0, got {conc!r}"
            if caps.memory_like:
                t = b.allocate("capcheck", 16, torch.float32)
                assert str(t.device) == str(torch.device(caps.device)), (
                    f"memory_like tensors declared on {caps.device!r} but allocated on {t.device}"
                )
                assert b.view("capcheck").data_ptr() == t.data_ptr()
            else:
                with pytest.raises(NotImplementedError):
                    b.allocate("capcheck", 16, torch.float32)
            if torch.cuda.is_available():  # every backend takes CUDA tensors; direct_gpu says how
                src = random_bytes(4096, seed=80).cuda()
                await b.write("gpu-direct", src)
                out = torch.empty_like(src)
                await b.read("gpu-direct", out)
                assert torch.equal(out.cpu(), src.cpu()), (
                    f"CUDA tensors do not round-trip{' (direct_gpu declared)' if caps.direct_gpu else ''}"
                )
            if caps.persistent:  # a second instance on the same place sees the bytes
                data = random_bytes(3000, seed=81)
                await b.write("persists", data)
                again = await self._reopen(b, tmp_path)
                try:
                    out = torch.empty_like(data)
                    await again.read("persists", out)
                    assert torch.equal(out, data), "persistent declared, but a new instance reads other bytes"
                finally:
                    await again.close()

        self.run(tmp_path, scenario)

    # ---- the I/O bridge ---------------------------------------------------------------------
    def test_uses_the_bridge_it_is_handed_and_outlives_it(self, tmp_path: Path) -> None:
        """[Note: one I/O bridge]: a backend takes its bridge from whoever opens it; once that
        bridge is closed (its manager went away) the backend falls back to the default one."""

        async def scenario(b: StorageBackend) -> None:
            bridge = IOBridge(2, name="conformance-bridge")
            try:
                b.use_bridge(bridge)
                assert b.bridge is bridge
                await self.roundtrip(b, "bridged", random_bytes(8 << 20, seed=21))
                await self.roundtrip(b, "bridged-small", random_bytes(100, seed=22))
            finally:
                bridge.close()
            assert b.bridge is default_bridge()
            await self.roundtrip(b, "bridged", random_bytes(3 << 20, seed=23))
            b.use_bridge(None)
            with pytest.raises(TypeError, match="IOBridge"):
                b.use_bridge(object())  # type: ignore[arg-type]

        self.run(tmp_path, scenario)

    def test_local_file_and_adopt_file(self, tmp_path: Path) -> None:
        """The optional `local_file` / `adopt_file` (docs/backends.md): the location holds the
        key's bytes (a large object, an odd-sized one off a block, a small one); an adopted file
        is what the next read returns, wherever the key lived before; a failed adoption leaves
        the object whole; later writes and reads of the key still work."""

        def stored(loc: LocalFile) -> bytes:
            with open(loc.path, "rb") as f:
                f.seek(loc.offset)
                return f.read(loc.nbytes)

        async def scenario(b: StorageBackend) -> bool:
            objects = {
                "local": random_bytes(3 * 4096 + 77, seed=31),
                "local-shifted": random_bytes(5 * 4096 + 99, seed=33)[64:],
                "local-small": random_bytes(100, seed=34),
                "local-big": random_bytes(3 << 20, seed=35),
            }
            for key, t in objects.items():
                await b.write(key, t)
            if all(b.local_file(k) is None for k in objects):
                return False
            for key, t in objects.items():
                loc = b.local_file(key)
                assert loc is not None, f"local_file({key!r}) is None where another key's is not"
                assert loc.nbytes == t.numel(), f"local_file({key!r}).nbytes {loc.nbytes}, wrote {t.numel()}"
                assert stored(loc) == t.numpy().tobytes(), f"{loc} does not hold key {key!r}'s bytes"
            for i, (key, t) in enumerate(objects.items()):
                new = random_bytes(t.numel() + 5 + 4096 * i, seed=40 + i)
                tmp = temp_path(Path(b.local_file(key).path).parent, key)  # type: ignore[union-attr]
                tmp.write_bytes(new.numpy().tobytes())
                await b.adopt_file(key, str(tmp))
                out = torch.empty_like(new)
                await b.read(key, out)
                assert torch.equal(out, new), f"an adopted file is not what the read of {key!r} returns"
                loc = b.local_file(key)
                assert loc is not None and stored(loc) == new.numpy().tobytes(), f"{key!r} after adopt_file"
                with pytest.raises(StorageIOError):
                    await b.adopt_file(key, str(tmp.with_name(tmp.name + "-missing")))
                await b.read(key, out)
                assert torch.equal(out, new), f"a failed adopt_file changed key {key!r}"
                await self.roundtrip(b, key, t)  # and the key is an ordinary one again
            return True

        if not self.run(tmp_path, scenario):
            pytest.skip("this backend keeps no key in a plain file (local_file returns None)")

    # ---- description ------------------------------------------------------------------------
    def test_capacity_is_sane(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            cap = b.capacity()
            assert isinstance(cap, Capacity)
            for v in (cap.total_bytes, cap.free_bytes):
                assert v is None or (isinstance(v, int) and v >= 0)
            if cap.total_bytes is not None and cap.free_bytes is not None:
                assert cap.free_bytes <= cap.total_bytes

        self.run(tmp_path, scenario)

    def test_capabilities_and_spec(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            caps = b.capabilities
            assert isinstance(caps, Capabilities)
            spec = b.spec()
            assert json.loads(json.dumps(spec)) == spec, "spec() must be JSON-able"
            assert spec["type"] == b.name
            if not self.check_spec_roundtrip:
                return
            from tiered.storage.registry import open_backend

            data = random_bytes(5000, seed=10)
            await b.write("persisted", data)
            async with open_backend(spec) as again:
                assert type(again) is type(b) and again.spec() == spec
                if caps.persistent:  # the reopened backend sees the same objects
                    out = torch.empty_like(data)
                    await again.read("persisted", out)
                    assert torch.equal(out, data)

        self.run(tmp_path, scenario)

    def test_close_is_idempotent(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            await b.write("x", torch.ones(3))
            await b.close()
            await b.close()

        self.run(tmp_path, scenario)

    # ---- memory-like backends ---------------------------------------------------------------
    def test_memory_like_allocate_and_view(self, tmp_path: Path) -> None:
        async def scenario(b: StorageBackend) -> None:
            if not b.capabilities.memory_like:
                with pytest.raises(NotImplementedError):
                    b.view("x")
                return
            t = b.allocate("res", 1000, torch.float32)
            assert t.shape == (1000,) and t.dtype == torch.float32
            t.copy_(torch.arange(1000, dtype=torch.float32))
            v = b.view("res")
            assert v.data_ptr() == t.data_ptr(), "view() must return the resident tensor, not a copy"
            out = torch.empty(1000, dtype=torch.float32)
            await b.read("res", out)
            assert torch.equal(out, torch.arange(1000, dtype=torch.float32))
            src = random_tensor((4, 6), torch.bfloat16, seed=11)
            await b.write("w", src)
            w = b.view("w")
            assert w.dtype == torch.bfloat16 and w.shape == (4, 6) and torch.equal(as_bytes(w), as_bytes(src))
            with pytest.raises(StorageKeyError):
                b.view("absent")

        self.run(tmp_path, scenario)


__all__ = [
    "ALL_DTYPES",
    "INVALID_KEYS",
    "UNALIGNED_SIZES",
    "BackendConformance",
    "as_bytes",
    "random_bytes",
    "random_tensor",
    "unaligned_empty",
]
