"""The nvme backend: conformance in several configurations plus O_DIRECT-specific behaviour."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

import pytest
import torch
from tiered_nvme import ALIGN, NVMeBackend

from tiered.device import default_device
from tiered.errors import ConfigError, StorageIOError
from tiered.storage import open_backend
from tiered.storage.files import is_temp_name
from tiered.testing import BackendConformance, random_bytes
from tiered.units import align_up


class TestNVMeConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return NVMeBackend(tmp_path)


class TestNVMeSmallChunksConformance(BackendConformance):
    """Many chunks per request, odd pool size: exercises the split/merge logic hard."""

    def make_backend(self, tmp_path):
        return NVMeBackend(tmp_path, block_size=16384, queue_depth=4, io_threads=3, fsync=False)


class TestNVMeBufferedConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return NVMeBackend(tmp_path, direct=False, chunk_bytes=1 << 20)


class TestNVMeScratchConformance(BackendConformance):
    """[Note: nvme scratch mode]: everything but the atomicity of a cancelled write."""

    atomic_writes = False  # in-place overwrites: same-key bursts are not promised whole

    def make_backend(self, tmp_path):
        return NVMeBackend(tmp_path, atomic=False, fsync=False)

    @pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.02])
    def test_cancelled_write_leaves_no_partial_object(self, tmp_path: Path, delay_s: float) -> None:
        # Scratch mode does not promise this (documented); what it does promise after a cancelled
        # in-place write: the backend still works, the file is rewritten whole by the next write.
        async def scenario(b) -> None:
            old, new = random_bytes(8 << 20, seed=7), random_bytes(8 << 20, seed=8)
            await b.write("victim", old)
            task = asyncio.ensure_future(b.write("victim", new))
            await asyncio.sleep(delay_s)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.roundtrip(b, "victim", random_bytes(100, seed=9))
            assert (tmp_path / "victim").stat().st_size == 100

        self.run(tmp_path, scenario)


def test_scratch_mode_overwrites_in_place_without_temp_files(tmp_path: Path, monkeypatch) -> None:
    b = NVMeBackend(tmp_path, atomic=False, fsync=False)
    renames: list[tuple] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (renames.append(a), real_replace(*a))[1])

    async def go() -> None:
        await b.write("k", random_bytes(3 << 20, seed=1))
        ino = (tmp_path / "k").stat().st_ino
        small = random_bytes(5000, seed=2)  # shorter and unaligned: the file shrinks to the payload
        await b.write("k", small)
        out = torch.empty_like(small)
        await b.read("k", out)
        assert torch.equal(out, small)
        assert (tmp_path / "k").stat().st_ino == ino and (tmp_path / "k").stat().st_size == 5000
        await b.close()

    _run(go())
    assert renames == [] and _no_temp_files(tmp_path)
    assert open_backend(b.spec()).atomic is False


def _run(coro):
    return asyncio.run(coro)


def _no_temp_files(directory: Path) -> bool:
    return not [p.name for p in directory.iterdir() if is_temp_name(p.name)]


def test_file_holds_exactly_the_payload(tmp_path: Path) -> None:
    async def main() -> None:
        b = NVMeBackend(tmp_path)
        assert b.direct, "ext4/xfs under tmp_path should accept O_DIRECT"
        for n in (1, 4095, 4097, (1 << 20) + 1):
            t = random_bytes(n, seed=n)
            await b.write(f"k{n}", t)
            path = tmp_path / f"k{n}"
            assert path.stat().st_size == n
            assert path.read_bytes() == t.numpy().tobytes()
        await b.close()

    _run(main())


def test_failure_after_first_chunk_keeps_old_copy_and_no_temp(tmp_path: Path, monkeypatch) -> None:
    b = NVMeBackend(tmp_path, block_size=1 << 20, queue_depth=1, io_threads=1)  # 1 MiB chunks, in order
    old = random_bytes(4 << 20, seed=1)
    _run(b.write("state", old))
    real_pwritev = os.pwritev
    calls = {"n": 0}

    def failing_pwritev(fd, buffers, offset, *args):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.EIO, "injected device error")
        return real_pwritev(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    with pytest.raises(StorageIOError, match=r"'state'.*state~tmp-.*injected device error") as info:
        _run(b.write("state", random_bytes(4 << 20, seed=2)))
    assert isinstance(info.value, OSError)
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    assert calls["n"] >= 2
    assert (tmp_path / "state").read_bytes() == old.numpy().tobytes(), "the good copy was damaged"
    assert _no_temp_files(tmp_path), "a temp file was left behind"
    _run(b.close())


def test_cancel_mid_write_keeps_old_copy_and_no_temp(tmp_path: Path, monkeypatch) -> None:
    real_pwritev = os.pwritev

    def slow_pwritev(fd, buffers, offset, *args):
        import time

        time.sleep(0.02)
        return real_pwritev(fd, buffers, offset, *args)

    async def main() -> None:
        b = NVMeBackend(tmp_path, block_size=1 << 20, queue_depth=1, io_threads=2)
        old = random_bytes(8 << 20, seed=3)
        await b.write("victim", old)
        monkeypatch.setattr(os, "pwritev", slow_pwritev)
        task = asyncio.ensure_future(b.write("victim", random_bytes(8 << 20, seed=4)))
        await asyncio.sleep(0.03)  # some chunks written, most not
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.setattr(os, "pwritev", real_pwritev)
        out = torch.empty_like(old)
        await b.read("victim", out)
        assert torch.equal(out, old)
        assert _no_temp_files(tmp_path)
        await b.close()

    _run(main())


def test_error_mid_read_names_key_and_file(tmp_path: Path, monkeypatch) -> None:
    b = NVMeBackend(tmp_path)
    _run(b.write("r", random_bytes(3 << 20, seed=5)))

    def broken(*_a, **_k):
        raise OSError(errno.EIO, "injected read error")

    monkeypatch.setattr(os, "preadv", broken)
    with pytest.raises(StorageIOError, match=r"'r'.*" + str(tmp_path / "r") + ".*injected read error"):
        _run(b.read("r", torch.empty(3 << 20, dtype=torch.uint8)))
    _run(b.close())


def test_falls_back_to_buffered_with_one_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    real_open = os.open
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        pytest.fail("this platform has no O_DIRECT; the nvme backend targets Linux")

    def no_direct_open(path, flags, *args, **kwargs):
        if flags & direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct_open)
    caplog.set_level(logging.WARNING, logger="tiered_nvme.backend")

    async def main() -> None:
        b = NVMeBackend(tmp_path)
        assert not b.direct
        for n in (5, 4097, (2 << 20) + 3):
            t = random_bytes(n, seed=n)
            await b.write("k", t)
            out = torch.empty_like(t)
            await b.read("k", out)
            assert torch.equal(out, t)
        await b.close()

    _run(main())
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert str(tmp_path) in warnings[0].getMessage()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")
def test_works_on_tmpfs() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:

        async def main() -> None:
            b = NVMeBackend(d)  # direct or buffered, depending on the kernel's tmpfs
            t = random_bytes((1 << 20) + 7, seed=6)
            await b.write("shm", t)
            out = torch.empty_like(t)
            await b.read("shm", out)
            assert torch.equal(out, t)
            await b.close()

        _run(main())


def test_missing_directory_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "deeper"
    with pytest.raises(StorageIOError, match=f"{missing}.*does not exist"):
        NVMeBackend(missing)
    with pytest.raises(StorageIOError, match=str(missing)):
        open_backend({"type": "nvme", "path": str(missing)})
    assert NVMeBackend(missing, create=True).directory == missing.resolve()


def test_path_that_is_a_file_names_path(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_bytes(b"x")
    with pytest.raises(StorageIOError, match=f"{f}.*not a directory"):
        NVMeBackend(f)


def test_unwritable_directory_names_path(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)  # root ignores chmod, so simulate EACCES
    with pytest.raises(StorageIOError, match=f"{tmp_path}.*not writable"):
        NVMeBackend(tmp_path)


def test_aligned_caller_buffer_needs_no_bounce_except_tail(tmp_path: Path) -> None:
    async def main() -> None:
        b = NVMeBackend(tmp_path)
        n = (16 << 20) + 100
        aligned = default_device().alloc_host(n, pin=False)
        assert aligned.data_ptr() % ALIGN == 0
        plan = b._plan(aligned)
        assert [p for p in plan if p.bounce] == [(16 << 20, ALIGN, True)]  # one block: 100 B of payload
        assert all(span % ALIGN == 0 for _, span, bounce in plan if not bounce)
        unaligned = torch.empty(n + 1, dtype=torch.uint8)[1:]
        assert all(bounce for *_, bounce in b._plan(unaligned))
        aligned.copy_(random_bytes(n, seed=8))
        await b.write("a", aligned)
        out = default_device().alloc_host(n, pin=False)
        await b.read("a", out)
        assert torch.equal(out, aligned)
        await b.close()

    _run(main())


def test_deepspeed_knobs_map_to_chunks_and_threads(tmp_path: Path) -> None:
    b = NVMeBackend(tmp_path, block_size=1 << 20, queue_depth=4, intra_op_parallelism=12, io_threads=2)
    assert b.chunk_bytes == 4 << 20
    assert b.workers == 12
    assert NVMeBackend(tmp_path, chunk_bytes=2 << 20).chunk_bytes == 2 << 20
    for bad in ({"block_size": 1000}, {"queue_depth": 0}, {"io_threads": -1}, {"chunk_bytes": 12345}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            NVMeBackend(tmp_path, **bad)


def test_spec_round_trips_non_defaults(tmp_path: Path) -> None:
    b = NVMeBackend(
        tmp_path, block_size=1 << 16, queue_depth=4, io_threads=3, fsync=False, chunk_bytes=1 << 18
    )
    again = open_backend(b.spec())
    assert again.spec() == b.spec()
    assert (again.block_size, again.queue_depth, again.io_threads, again.chunk_bytes, again.fsync) == (
        1 << 16,
        4,
        3,
        1 << 18,
        False,
    )


def test_wrong_option_is_config_error_listing_accepted(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'blocksize'.*'block_size'.*Accepted options: path, block_size"):
        open_backend({"type": "nvme", "path": str(tmp_path), "blocksize": 4096})


def test_plan_covers_every_byte_once_with_aligned_direct_pieces(tmp_path: Path) -> None:
    """[Note: nvme shifted swap files]: for any payload size, file shift and buffer shift, the
    pieces tile the payload's blocks once, every span is aligned, and a direct piece's memory is
    aligned too; when the shifts agree, at most a head and a tail block bounce."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    b = NVMeBackend(tmp_path, block_size=4096, queue_depth=4)  # 16 KiB chunks: many pieces
    base = default_device().alloc_host(300_000 + 2 * ALIGN, pin=False)

    @settings(max_examples=80, deadline=None, database=None)
    @given(
        n=st.integers(1, 300_000), mem=st.integers(0, ALIGN - 1), same=st.booleans(), file=st.integers(0, 63)
    )
    def check(n: int, mem: int, same: bool, file: int) -> None:
        shift = mem if same else file
        buf = base[mem : mem + n]
        plan = b._plan(buf, shift)
        assert plan[0].offset == 0 and sum(p.span for p in plan) == align_up(shift + n, ALIGN)
        pos = 0
        for off, span, bounce in plan:
            assert off == pos and 0 < span <= b.chunk_bytes and off % ALIGN == 0 and span % ALIGN == 0
            if not bounce:  # O_DIRECT straight from the caller's memory: everything aligned
                assert (buf.data_ptr() + off - shift) % ALIGN == 0
            pos += span
        if shift == mem:
            assert sum(p.span for p in plan if p.bounce) <= 2 * ALIGN

    check()
