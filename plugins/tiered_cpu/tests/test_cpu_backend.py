"""The pinned CPU backend: conformance plus pool reuse and the max_bytes budget."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiered_cpu import PinnedCPUBackend

from tiered.device import PAGE_SIZE
from tiered.errors import CapacityError
from tiered.storage import open_backend
from tiered.testing import BackendConformance, random_bytes


class TestPinnedCPUConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return PinnedCPUBackend()


class TestPinnedCPUBudgetedConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return PinnedCPUBackend(max_bytes="1GiB")


def test_steady_state_allocates_nothing() -> None:
    async def main() -> None:
        b = PinnedCPUBackend()
        sizes = [10_000, (5 << 20) + 3, 123]
        for step in range(4):
            for i, n in enumerate(sizes):
                await b.write(f"p{i}", random_bytes(n, seed=step * 10 + i))
            for i in range(len(sizes)):
                await b.delete(f"p{i}")
            if step == 0:
                fresh_after_first = b.pool_stats().fresh_allocations
        assert b.pool_stats().fresh_allocations == fresh_after_first
        assert b.pool_stats().reuses >= 3 * len(sizes)
        await b.close()

    asyncio.run(main())


def test_resident_buffers_are_page_aligned() -> None:
    async def main() -> None:
        b = PinnedCPUBackend()
        t = b.allocate("a", 1001, torch.float16)
        assert t.data_ptr() % PAGE_SIZE == 0
        await b.write("b", torch.ones(77))
        assert b.view("b").data_ptr() % PAGE_SIZE == 0
        await b.close()

    asyncio.run(main())


def test_max_bytes_is_a_hard_budget_naming_the_key() -> None:
    async def main() -> None:
        b = open_backend({"type": "cpu", "max_bytes": "1MiB"})
        await b.write("fits", torch.zeros(600_000, dtype=torch.uint8))
        with pytest.raises(CapacityError, match="'too-big'.*max_bytes"):
            await b.write("too-big", torch.zeros(600_000, dtype=torch.uint8))
        assert not await b.exists("too-big")
        await b.delete("fits")
        await b.write("too-big", torch.zeros(600_000, dtype=torch.uint8))  # space came back
        cap = b.capacity()
        assert cap.total_bytes == 1 << 20 and cap.free_bytes is not None and cap.free_bytes < 500_000
        await b.close()

    asyncio.run(main())


def test_bad_max_bytes_is_config_error() -> None:
    from tiered.errors import ConfigError

    with pytest.raises(ConfigError, match="max_bytes"):
        PinnedCPUBackend(max_bytes="lots")


def test_concurrent_large_writes_to_one_key_release_each_buffer_once() -> None:
    async def main() -> None:
        b = PinnedCPUBackend()
        values = [random_bytes(6 << 20, seed=s) for s in range(4)]
        await asyncio.gather(*(b.write("same", v) for v in values))
        final = b.view("same")
        assert any(torch.equal(final, v) for v in values)
        stats = b.pool_stats()
        assert stats.in_use_bytes < 2 * (6 << 20), f"buffers leaked or double-released: {stats}"
        await b.delete("same")
        assert b.pool_stats().in_use_bytes == 0
        bufs = {id(x) for xs in b.pool._free.values() for x in xs}
        assert len(bufs) == sum(len(xs) for xs in b.pool._free.values()), "a buffer was released twice"
        await b.close()

    asyncio.run(main())
