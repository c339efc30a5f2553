"""Errors raised on the loop reach the caller with context; state stays consistent; nothing hangs."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiers_support import MemBackend, backend, three_tier_manager

from tiered.errors import StorageIOError, TierTimeoutError
from tiered.tiers import CopyState, Tier, TierManager


@pytest.fixture
def mgr(tmp_path):
    m = three_tier_manager(tmp_path, timeout_s=5.0)
    yield m
    m.close()


def test_read_failure_reaches_every_waiter_with_context_and_leaves_no_reservation(mgr):
    nv = backend(mgr, "nvme")
    p = mgr.create("p", 256, torch.float32, "nvme", init=torch.ones(256))
    nv.faults.fail_read.add("p")
    nv.faults.delay_s = 0.05  # so the second fetch joins the first one's move
    f1, f2 = mgr.fetch(p, "gpu"), mgr.prefetch(p, "gpu")
    for f in (f1, f2):
        with pytest.raises(StorageIOError) as ei:
            f.result()
        msg = str(ei.value)
        assert "fetch of partition 'p'" in msg and "nvme->gpu" in msg and "key 'p'" in msg
        assert "injected read failure" in msg
    assert p.state("gpu") is CopyState.ABSENT and p.pin_count("gpu") == 0
    assert mgr.resident_bytes("gpu") == 0 and backend(mgr, "gpu").held_bytes == 0
    # the failure is not sticky: once the backend recovers, the same fetch works
    nv.faults.fail_read.clear()
    assert torch.equal(mgr.fetch(p, "gpu").result(), torch.ones(256))


def test_write_back_failure_on_evict_keeps_the_dirty_copy(mgr):
    nv = backend(mgr, "nvme")
    p = mgr.create("p", 256, torch.float32, "nvme")
    t = mgr.fetch(p, "gpu").result()
    t.fill_(3.0)
    mgr.mark_dirty(p, "gpu")
    mgr.release(p, "gpu")
    nv.faults.fail_write.add("p")
    with pytest.raises(
        StorageIOError, match=r"evict write-back of partition 'p'.*gpu->nvme.*injected write failure"
    ):
        mgr.evict(p, "gpu").result()
    assert p.state("gpu") is CopyState.DIRTY and p.state("nvme") is CopyState.STALE
    assert mgr.resident_bytes("gpu") == 1024
    nv.faults.fail_write.clear()
    mgr.evict(p, "gpu").result()
    assert p.valid_in() == frozenset({"nvme"})
    assert torch.equal(mgr.fetch(p, "cpu").result(), torch.full((256,), 3.0))


def test_write_back_failure_while_making_room_fails_the_request_not_the_victim(mgr):
    nv = backend(mgr, "nvme")
    victim = mgr.create("victim", 1024, torch.float32, "nvme")  # fills the 4 KiB gpu
    newcomer = mgr.create("newcomer", 512, torch.float32, "nvme")
    mgr.allocate(victim, "gpu").result().fill_(9.0)
    mgr.release(victim, "gpu")
    nv.faults.fail_write.add("victim")
    with pytest.raises(StorageIOError, match=r"partition 'victim'.*injected write failure"):
        mgr.fetch(newcomer, "gpu").result()
    assert newcomer.state("gpu") is CopyState.ABSENT
    assert victim.state("gpu") is CopyState.DIRTY
    assert mgr.resident_bytes("gpu") == 4096 == backend(mgr, "gpu").held_bytes
    nv.faults.fail_write.clear()
    mgr.fetch(newcomer, "gpu").result()
    assert torch.equal(mgr.fetch(victim, "cpu").result(), torch.full((1024,), 9.0))


def test_flush_failure_is_reported_and_retry_succeeds(mgr):
    nv = backend(mgr, "nvme")
    p = mgr.create("p", 64, torch.float32, "nvme")
    mgr.allocate(p, "cpu").result().fill_(4.0)
    nv.faults.fail_write.add("p")
    with pytest.raises(StorageIOError, match=r"flush of partition 'p'.*cpu->nvme"):
        mgr.flush().result()
    assert p.dirty_in() == frozenset({"cpu"})
    nv.faults.fail_write.clear()
    mgr.flush(p).result()
    assert p.state("nvme") is CopyState.VALID and p.state("cpu") is CopyState.VALID


def test_create_failure_leaves_nothing_behind(mgr):
    nv = backend(mgr, "nvme")
    nv.faults.fail_write.add("bad")
    with pytest.raises(
        StorageIOError, match=r"create of partition 'bad' in tier 'nvme'.*injected write failure"
    ):
        mgr.create("bad", 64, torch.float32, "nvme")
    assert mgr.resident_bytes("nvme") == 0 and [p.name for p in mgr.partitions()] == []
    nv.faults.fail_write.clear()
    mgr.create("bad", 64, torch.float32, "nvme")


def test_allocate_failure_in_backend_returns_the_reservation(tmp_path):
    class Broken(MemBackend):
        def allocate(self, key, numel, dtype):
            raise RuntimeError("device out of memory (injected)")

    with TierManager([Tier("gpu", Broken(), 4096), Tier("cpu", MemBackend())], timeout_s=5) as m:
        p = m.create("p", 64, torch.float32, "cpu")
        with pytest.raises(RuntimeError, match=r"allocate of partition 'p' in tier 'gpu'.*out of memory"):
            m.allocate(p, "gpu").result()
        with pytest.raises(RuntimeError, match=r"fetch of partition 'p' in tier 'gpu'.*out of memory"):
            m.fetch(p, "gpu").result()
        assert m.resident_bytes("gpu") == 0 and p.state("gpu") is CopyState.ABSENT
        assert p.valid_in() == frozenset({"cpu"})


def test_a_hung_backend_times_out_instead_of_hanging(tmp_path):
    with three_tier_manager(tmp_path, timeout_s=0.3) as m:
        nv = backend(m, "nvme")
        p = m.create("p", 64, torch.float32, "nvme")
        nv.faults.delay_s = 30.0
        with pytest.raises(TierTimeoutError, match=r"partition 'p'.*did not answer within 0\.3 s"):
            m.fetch(p, "gpu").result(timeout=10)
        assert p.state("gpu") is CopyState.ABSENT and m.resident_bytes("gpu") == 0


def test_result_timeout_names_partition_and_operation(tmp_path):
    with three_tier_manager(tmp_path, timeout_s=5) as m:
        backend(m, "nvme").faults.delay_s = 0.3
        p = m.create("slowpart", 64, torch.float32, "nvme")
        f = m.prefetch(p, "cpu")
        with pytest.raises(
            TierTimeoutError,
            match="prefetch of partition 'slowpart' to tier 'cpu' did not finish within 0.05 s",
        ):
            f.result(timeout=0.05)
        f.result(timeout=10)  # the operation kept running and completes
        assert p.is_resident("cpu")


def test_loop_errors_keep_their_builtin_type(mgr):
    # a backend raising a plain builtin keeps it catchable as that builtin, with the context prefixed
    nv = backend(mgr, "nvme")
    p = mgr.create("p", 64, torch.float32, "nvme")

    async def bad_read(key, out):
        raise ValueError("size mismatch (injected)")

    nv.read = bad_read  # type: ignore[method-assign]
    with pytest.raises(
        ValueError, match=r"fetch of partition 'p'.*nvme->cpu.*size mismatch \(injected\)"
    ) as ei:
        mgr.fetch(p, "cpu").result()
    assert isinstance(ei.value.__cause__, ValueError)
    assert asyncio.iscoroutinefunction(bad_read)
