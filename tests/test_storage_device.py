"""Device (CPU path), size classes and the buffer pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tiered.device import PAGE_SIZE, CopyEvent, Device, default_device, is_aligned
from tiered.errors import CapacityError
from tiered.storage.pool import BufferPool, size_class


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4097, (1 << 20) + 3, 5 << 20])
def test_alloc_host_is_page_aligned(nbytes: int) -> None:
    t = Device("cpu").alloc_host(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and is_aligned(t, PAGE_SIZE)
    t.fill_(7)  # the whole range is writable


def test_cpu_copy_and_events_complete_immediately() -> None:
    d = Device("cpu")
    src, dst = torch.arange(100.0), torch.empty(100)
    ev = d.copy_async(dst, src)
    assert ev.query() and torch.equal(dst, src)
    asyncio.run(d.wait(ev))
    d.synchronize()
    assert d.record_event().query() and d.copy_stream is None and not d.is_cuda


def test_device_selection_errors() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        Device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            Device("cuda")
        assert default_device().kind == "cpu"


def test_wait_times_out_naming_what() -> None:
    class Never:
        def query(self) -> bool:
            return False

    from tiered.errors import TierTimeoutError

    with pytest.raises(TierTimeoutError, match="partition p7"):
        asyncio.run(Device("cpu").wait(CopyEvent(Never()), timeout_s=0.05, what="partition p7"))


def test_mem_info_is_sane() -> None:
    free, total = Device("cpu").mem_info()
    assert total is None or (free is not None and 0 <= free <= total)


def test_size_classes_waste_at_most_a_quarter() -> None:
    prev = 0
    for n in list(range(1, 70_000, 997)) + [1 << 20, (1 << 20) + 1, (64 << 20) - 1, 3 << 30]:
        c = size_class(n)
        assert c >= n and c % 4096 == 0 and c >= prev
        assert n <= 4096 or c <= n * 1.25 + 4096
        prev = c


def test_pool_budget_trims_cache_then_refuses() -> None:
    allocs: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        allocs.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = BufferPool(alloc, max_bytes=64 << 10, name="test pool")
    a = pool.acquire(40 << 10)
    pool.release(a)
    b = pool.acquire(40 << 10)  # reused
    assert len(allocs) == 1 and pool.stats().reuses == 1
    pool.release(b)
    c = pool.acquire(60 << 10)  # needs the cached 40K dropped
    assert pool.stats().cached_bytes == 0 and len(allocs) == 2
    with pytest.raises(CapacityError, match="test pool: key 'z'.*max_bytes"):
        pool.acquire(8 << 10, what="key 'z'")
    pool.release(c)
    assert pool.stats().in_use_bytes == 0


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs Linux /proc")
def test_host_memory_free_is_what_the_kernel_could_give_not_its_free_pages(monkeypatch) -> None:
    """A machine that has read files for a while has little MemFree and much page cache: the
    cpu tier's budget (and the residency room it lends) is MemAvailable, within a container's
    memory limit."""
    import tiered.device as device

    fields = dict(
        line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line
    )
    kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if v.split()}
    monkeypatch.setattr(device, "_cgroup_memory_limit", lambda: None)
    avail, total = device.host_mem_info()
    assert total == kib["MemTotal"]
    assert abs(avail - kib["MemAvailable"]) < 256 * 2**20  # read a moment apart
    assert avail >= kib["MemFree"] - 256 * 2**20
    monkeypatch.setattr(device, "_cgroup_memory_limit", lambda: (2**30, 2**28))  # 1 GiB, 256 MiB used
    capped, limit = device.host_mem_info()
    assert limit == 2**30 and capped is not None and capped <= 3 * 2**28
