"""Swap mode's in-memory index: slab coalescing and shifted files read back bitwise.

[Note: nvme swap index], [Note: nvme slab coalescing], [Note: nvme shifted swap files]."""

from __future__ import annotations

import asyncio
import threading
import zlib
from pathlib import Path

import pytest
import torch
from tiered_nvme import ALIGN, NVMeBackend
from tiered_nvme.slab import SlabSlots
from tiered_nvme.swapstore import SLAB_FILE

from tiered.device import default_device
from tiered.errors import StorageKeyError
from tiered.testing import random_bytes


def _swap(tmp_path: Path, **kw) -> NVMeBackend:
    return NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True, **kw)


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy().tobytes())


def _aligned(n: int) -> torch.Tensor:
    return default_device().alloc_host(n, pin=False)


SIZES = [64 << 10, 100_000, 128 << 10, 4097, 1 << 20, 256 << 10, 1, 777_777, 512 << 10] * 4


def test_a_layer_of_small_partitions_is_coalesced_and_reads_back_bitwise(tmp_path: Path) -> None:
    """Each partition has its own checksum; the batch goes out as few merged syscalls, not one
    per partition, and no partition gets its own file."""

    async def go() -> None:
        b = _swap(tmp_path)
        srcs = []
        for i, n in enumerate(SIZES):
            t = _aligned(n) if i % 3 else torch.empty(n, dtype=torch.uint8)  # aligned and not
            t.copy_(random_bytes(n, seed=100 + i))
            srcs.append(t)
        sums = [_crc(t) for t in srcs]
        keys = [f"layer0.p{i}" for i in range(len(SIZES))]
        calls0 = b._store.coalescer.syscalls
        await asyncio.gather(*(b.write(k, t) for k, t in zip(keys, srcs, strict=True)))
        writes = b._store.coalescer.syscalls - calls0
        assert writes < len(SIZES) // 3, f"{writes} syscalls for {len(SIZES)} small writes: not coalesced"
        assert {p.name for p in b.directory.iterdir()} == {SLAB_FILE, "lock"}
        outs = [_aligned(n) if i % 2 else torch.empty(n, dtype=torch.uint8) for i, n in enumerate(SIZES)]
        for o in outs:
            o.fill_(0xAB)
        calls1 = b._store.coalescer.syscalls
        await asyncio.gather(*(b.read(k, o) for k, o in zip(keys, outs, strict=True)))
        assert b._store.coalescer.syscalls - calls1 < len(SIZES) // 3
        for i, o in enumerate(outs):
            assert _crc(o) == sums[i], f"partition {i} ({SIZES[i]} B) read back other bytes"
        # a second step rewrites every slot in place: same slots, same bytes back
        slots = {k: b._store.entries[k].slot for k in keys}
        for t in srcs:
            t.add_(1)
        await asyncio.gather(*(b.write(k, t) for k, t in zip(keys, srcs, strict=True)))
        assert {k: b._store.entries[k].slot for k in keys} == slots
        await asyncio.gather(*(b.read(k, o) for k, o in zip(keys, outs, strict=True)))
        assert all(torch.equal(o, t) for o, t in zip(outs, srcs, strict=True))
        await b.close()

    asyncio.run(go())


def test_a_key_moves_between_slab_and_file_and_frees_what_it_left(tmp_path: Path) -> None:
    async def go() -> None:
        b = _swap(tmp_path, coalesce_bytes=64 << 10)
        small, big, small2 = (
            random_bytes(10_000, seed=1),
            random_bytes(3 << 20, seed=2),
            random_bytes(5, seed=3),
        )
        await b.write("k", small)
        first = b._store.entries["k"].slot
        assert first is not None and not (b.directory / "k").exists()
        await b.write("k", big)  # to a file of its own; the slot is freed
        assert b._store.entries["k"].slot is None and (b.directory / "k").exists()
        assert b._store.slots.free_bytes() == first.capacity
        out = torch.empty_like(big)
        await b.read("k", out)
        assert torch.equal(out, big)
        await b.write("k", small2)  # back to the slab: the file is gone
        assert not (b.directory / "k").exists()
        out = torch.empty_like(small2)
        await b.read("k", out)
        assert torch.equal(out, small2)
        await b.delete("k")
        assert not await b.exists("k")
        with pytest.raises(StorageKeyError, match="'k'"):
            await b.read("k", out)
        await b.close()

    asyncio.run(go())


def test_slab_slots_are_reused_by_size_and_never_overlap() -> None:
    slots = SlabSlots()
    a, b_, c = slots.take(5000), slots.take(4096), slots.take(1 << 20)
    assert (a.offset, a.capacity, b_.offset, c.offset) == (0, 2 * ALIGN, 2 * ALIGN, 3 * ALIGN)
    slots.give(a)
    assert slots.take(4096).offset == 4 * ALIGN + (1 << 20) - ALIGN  # another size: a fresh slot
    assert slots.take(8000) == a  # the freed slot of that size


@pytest.mark.parametrize("write_shift,read_shift", [(64, 64), (64, 0), (0, 64), (1, 4095), (100, 100)])
def test_unaligned_buffers_round_trip_through_shifted_files(
    tmp_path: Path, write_shift: int, read_shift: int
) -> None:
    """[Note: nvme shifted swap files]: the file keeps the writer's shift; a reader with the same
    shift reads directly, any other shift through the bounce buffers: the same bytes either way."""

    async def go() -> None:
        b = _swap(tmp_path, block_size=ALIGN, queue_depth=4)  # 16 KiB chunks: many pieces
        n = (3 << 20) + 123
        base = _aligned(n + 2 * ALIGN)
        src = base[write_shift : write_shift + n]
        src.copy_(random_bytes(n, seed=5))
        await b.write("big", src)
        entry = b._store.entries["big"]
        assert entry.shift == write_shift % ALIGN and entry.slot is None
        assert (b.directory / "big").stat().st_size == -(-(entry.shift + n) // ALIGN) * ALIGN
        dbase = _aligned(n + 2 * ALIGN)
        dst = dbase[read_shift : read_shift + n]
        await b.read("big", dst)
        assert _crc(dst) == _crc(src)
        await b.close()

    asyncio.run(go())


def test_a_cancelled_coalesced_read_never_touches_out_after_it_returned(tmp_path: Path) -> None:
    async def go() -> None:
        b = _swap(tmp_path)
        data = [random_bytes(256 << 10, seed=i) for i in range(16)]
        await asyncio.gather(*(b.write(f"c{i}", d) for i, d in enumerate(data)))
        for delay in (0, 0.0005, 0.005):
            outs = [torch.zeros(256 << 10, dtype=torch.uint8) for _ in data]
            tasks = [asyncio.ensure_future(b.read(f"c{i}", o)) for i, o in enumerate(outs)]
            await asyncio.sleep(delay)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            seen = [o.clone() for o in outs]
            await asyncio.sleep(0.05)
            assert all(torch.equal(o, s) for o, s in zip(outs, seen, strict=True))
        outs = [torch.empty(256 << 10, dtype=torch.uint8) for _ in data]
        await asyncio.gather(*(b.read(f"c{i}", o) for i, o in enumerate(outs)))
        assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
        await b.close()

    asyncio.run(go())


def test_coalesce_bytes_zero_keeps_one_file_per_key_and_round_trips_in_the_spec(tmp_path: Path) -> None:
    async def go() -> None:
        b = _swap(tmp_path, coalesce_bytes=0)
        await b.write("s", random_bytes(1000, seed=9))
        assert (b.directory / "s").exists() and not (b.directory / SLAB_FILE).exists()
        assert b.spec()["coalesce_bytes"] == 0
        await b.close()

    asyncio.run(go())


def test_a_failed_slab_write_is_a_storage_error_naming_the_key(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    from tiered.errors import StorageIOError

    async def go() -> None:
        b = _swap(tmp_path)
        await b.write("fine", random_bytes(8192, seed=1))

        def broken(*_a, **_k):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "pwritev", broken)
        with pytest.raises(StorageIOError, match="'doomed'.*slab") as info:
            await b.write("doomed", random_bytes(8192, seed=2))
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
        monkeypatch.undo()
        assert not await b.exists("doomed")
        out = torch.empty(8192, dtype=torch.uint8)
        await b.read("fine", out)
        assert torch.equal(out, random_bytes(8192, seed=1))
        await b.close()

    asyncio.run(go())


def test_a_swap_file_keeps_its_blocks_for_a_small_shrink_and_gives_back_a_large_one(tmp_path: Path) -> None:
    async def go() -> None:
        b = _swap(tmp_path)
        path = b.directory / "f"
        base = _aligned((8 << 20) + ALIGN)
        await b.write("f", base[64 : 64 + (8 << 20)])  # shifted: 8 MiB + one block on disk
        assert path.stat().st_size == (8 << 20) + ALIGN
        await b.write("f", base[: 8 << 20])  # one block less: kept, no truncate
        assert path.stat().st_size == (8 << 20) + ALIGN
        small = random_bytes(2 << 20, seed=3)
        await b.write("f", small)  # a quarter: the disk space goes back
        assert path.stat().st_size == -(-(b._store.entries["f"].shift + (2 << 20)) // ALIGN) * ALIGN
        out = torch.empty_like(small)
        await b.read("f", out)
        assert torch.equal(out, small)
        await b.close()

    asyncio.run(go())


def test_a_slab_run_cancelled_before_it_started_releases_its_callers(tmp_path: Path) -> None:
    """Closing a tier manager cancels every task of its loop at once, among them a merged slab
    run whose task has been created but not yet stepped: its body never runs, so nothing may wait
    for the syscall it never issued. (The hang this guards against held a SIGTERM-ed training
    script in close for the full 60 s timeout.)"""

    async def go() -> None:
        b = _swap(tmp_path)
        coalescer = b._store.coalescer
        me = asyncio.current_task()
        flush = coalescer._flush

        def flush_then_cancel_everything() -> None:
            flush()  # creates the run's task; its first step is only scheduled
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()

        coalescer._flush = flush_then_cancel_everything  # type: ignore[method-assign]
        writes = [asyncio.ensure_future(b.write(f"p{i}", _aligned(64 << 10))) for i in range(4)]
        done, pending = await asyncio.wait(writes, timeout=10)
        assert not pending, "a cancelled write waits for a slab run that never started"
        assert all(w.cancelled() for w in done)
        assert coalescer.syscalls == 0, "the cancelled run issued its syscall"
        coalescer._flush = flush  # type: ignore[method-assign]
        await b.close()

    # in a thread of its own: without the fix the loop never ends, and the test must fail, not hang
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            asyncio.run(go())
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert outcome, "the event loop never finished: a cancelled write is still waiting"
    if outcome[0] is not None:
        raise outcome[0]
