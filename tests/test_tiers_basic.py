"""TierManager: the basic contract (create, fetch, prefetch, allocate, release, evict, flush, drop)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from tiers_support import DiskBackend, MemBackend, backend, three_tier_manager

from tiered.errors import CapacityError, StorageIOError, TierTimeoutError
from tiered.tiers import CopyState, LRUPolicy, PinnedError, Tier, TierFuture, TierManager


@pytest.fixture
def mgr(tmp_path):
    m = three_tier_manager(tmp_path, record_trace=True)
    yield m
    m.close()


def rand(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def test_create_writes_init_to_home_and_fetch_reads_it_back(mgr):
    init = rand(256)
    p = mgr.create("w0", 256, torch.float32, "nvme", init=init)
    assert p.nbytes == 1024 and p.home == "nvme"
    assert p.valid_in() == frozenset({"nvme"})
    assert mgr.resident_bytes("nvme") == 1024
    t = mgr.fetch(p, "gpu").result()
    assert isinstance(t, torch.Tensor) and t.shape == (256,) and t.dtype == torch.float32
    assert torch.equal(t, init)
    assert p.valid_in() == frozenset({"gpu", "nvme"})
    assert p.pin_count("gpu") == 1 and p.is_resident("gpu")
    # the result is the backend's resident tensor itself: no hidden copy
    assert t.data_ptr() == backend(mgr, "gpu").view("w0").data_ptr()
    mgr.release(p, "gpu")
    assert p.pin_count("gpu") == 0


def test_create_without_init_is_zero_filled(mgr):
    p = mgr.create("z", 100, torch.bfloat16, "cpu")
    t = mgr.fetch(p, "cpu").result()
    assert torch.equal(t, torch.zeros(100, dtype=torch.bfloat16))
    q = mgr.create("zn", 100, torch.bfloat16, "nvme")
    assert torch.equal(mgr.fetch(q, "gpu").result(), torch.zeros(100, dtype=torch.bfloat16))


def test_fetch_from_memory_tier_copies_and_fetch_from_disk_reads(mgr):
    p = mgr.create("a", 64, torch.float32, "cpu", init=rand(64, seed=1))
    t = mgr.fetch(p, "gpu").result()
    assert torch.equal(t, rand(64, seed=1))
    links = mgr.stats()["links"]
    assert links["cpu->gpu"]["ops"] == 1 and links["cpu->gpu"]["bytes"] == 256


def test_fetch_prefers_fastest_valid_copy(mgr):
    p = mgr.create("a", 64, torch.float32, "nvme", init=rand(64))
    mgr.prefetch(p, "cpu").result()
    mgr.fetch(p, "gpu").result()
    links = mgr.stats()["links"]
    assert links["cpu->gpu"]["ops"] == 1
    assert "nvme->gpu" not in links


def test_duplicate_name_and_bad_arguments(mgr):
    mgr.create("dup", 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="'dup' already exists"):
        mgr.create("dup", 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown tier 'ssd'"):
        mgr.create("x", 8, torch.float32, "ssd")
    with pytest.raises(ValueError, match="numel must be a positive int"):
        mgr.create("x", 0, torch.float32, "cpu")
    with pytest.raises(ValueError, match="partition name 'a/b'"):
        mgr.create("a/b", 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="init has 4 elements of torch.float32, expected 8"):
        mgr.create("x", 8, torch.float32, "cpu", init=torch.zeros(4))
    p = mgr.get("dup")
    with pytest.raises(ValueError, match="not memory-like"):
        mgr.fetch(p, "nvme")


def test_partition_bigger_than_home_budget_is_capacity_error(mgr):
    with pytest.raises(CapacityError, match=r"partition 'big'.*tier 'gpu'.*budget 4\.00 KiB"):
        mgr.create("big", 2048, torch.float32, "gpu")  # 8 KiB > 4 KiB
    assert "big" not in [p.name for p in mgr.partitions()]
    assert mgr.resident_bytes("gpu") == 0


def test_fetch_that_can_never_fit_is_capacity_error_at_once(mgr):
    mgr.create("home_on_gpu", 768, torch.float32, "gpu")  # 3 KiB of the 4 KiB gpu budget, for life
    p = mgr.create("p", 512, torch.float32, "nvme")  # 2 KiB: fits the budget, not budget - home bytes
    with pytest.raises(CapacityError, match="whose home is 'gpu'"):
        mgr.fetch(p, "gpu").result(timeout=5)
    assert p.state("gpu") is CopyState.ABSENT
    assert mgr.resident_bytes("gpu") == 3072


def test_release_without_pin_is_an_error(mgr):
    p = mgr.create("p", 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="'p' in tier 'gpu': it is not pinned"):
        mgr.release(p, "gpu")


def test_eviction_of_clean_copy_costs_no_write(mgr):
    p = mgr.create("p", 256, torch.float32, "nvme", init=rand(256))
    mgr.fetch(p, "gpu").result()
    mgr.release(p, "gpu")
    writes_before = mgr.stats()["tiers"]["nvme"]["writes"]
    mgr.evict(p, "gpu").result()
    s = mgr.stats()
    assert s["clean_drops"] == 1 and s["writebacks"] == 0 and s["evictions"] == 1
    assert s["tiers"]["nvme"]["writes"] == writes_before
    assert p.valid_in() == frozenset({"nvme"})
    assert mgr.resident_bytes("gpu") == 0
    assert backend(mgr, "gpu").held_bytes == 0


def test_dirty_copy_is_written_back_on_evict_and_reads_back_identical(mgr):
    p = mgr.create("p", 256, torch.float32, "nvme", init=rand(256))
    t = mgr.fetch(p, "gpu").result()
    t.mul_(3).add_(1)
    want = t.clone()
    mgr.mark_dirty(p, "gpu")
    assert p.dirty_in() == frozenset({"gpu"}) and p.state("nvme") is CopyState.STALE
    mgr.release(p, "gpu")
    mgr.evict(p, "gpu").result()
    s = mgr.stats()
    assert s["writebacks"] == 1 and s["clean_drops"] == 0
    assert p.valid_in() == frozenset({"nvme"})
    assert torch.equal(mgr.fetch(p, "cpu").result(), want)


def test_allocate_gives_pinned_dirty_buffer_without_a_read(mgr):
    p = mgr.create("g", 128, torch.float32, "nvme", init=rand(128))
    reads = mgr.stats()["tiers"]["nvme"]["reads"]
    buf = mgr.allocate(p, "gpu").result()
    assert mgr.stats()["tiers"]["nvme"]["reads"] == reads
    assert p.pin_count("gpu") == 1 and p.dirty_in() == frozenset({"gpu"})
    assert p.valid_in() == frozenset({"gpu"})
    buf.fill_(7.0)
    mgr.release(p, "gpu")
    mgr.flush().result()
    assert p.valid_in() == frozenset({"gpu", "nvme"}) and not p.dirty_in()
    mgr.evict(p, "gpu").result()
    assert mgr.stats()["clean_drops"] == 1  # flushed: the eviction is free
    assert torch.equal(mgr.fetch(p, "cpu").result(), torch.full((128,), 7.0))


def test_mark_dirty_frees_unpinned_stale_copies(mgr):
    p = mgr.create("p", 64, torch.float32, "nvme", init=rand(64))
    mgr.prefetch(p, "cpu").result()
    t = mgr.fetch(p, "gpu").result()
    t.zero_()
    mgr.mark_dirty(p, "gpu")
    mgr.flush(p).result()  # the loop ran the free by now; flush also waits for the write-back
    assert p.state("cpu") is CopyState.ABSENT
    assert mgr.resident_bytes("cpu") == 0
    assert torch.equal(mgr.fetch(p, "cpu").result(), torch.zeros(64))


def test_mark_dirty_on_home_memory_tier_invalidates_faster_copies(mgr):
    p = mgr.create("p", 64, torch.float32, "cpu", init=rand(64))
    g = mgr.fetch(p, "gpu").result()  # pinned: stays, but stale
    c = mgr.fetch(p, "cpu").result()
    c.fill_(2.0)
    mgr.mark_dirty(p, "cpu")
    assert p.state("gpu") is CopyState.STALE and p.valid_in() == frozenset({"cpu"})
    # a second fetch refreshes the stale pinned copy in place
    g2 = mgr.fetch(p, "gpu").result()
    assert g2.data_ptr() == g.data_ptr() and torch.equal(g2, torch.full((64,), 2.0))
    assert p.pin_count("gpu") == 2


def test_fetch_to_stale_home_brings_dirty_bytes_home(mgr):
    p = mgr.create("p", 64, torch.float32, "cpu", init=rand(64))
    g = mgr.fetch(p, "gpu").result()
    g.fill_(5.0)
    mgr.mark_dirty(p, "gpu")
    c = mgr.fetch(p, "cpu").result()
    assert torch.equal(c, torch.full((64,), 5.0))
    assert p.state("cpu") is CopyState.VALID and p.state("gpu") is CopyState.VALID


def test_evict_pinned_or_home_is_an_error_naming_the_partition(mgr):
    p = mgr.create("pp", 64, torch.float32, "nvme")
    mgr.fetch(p, "gpu").result()
    with pytest.raises(PinnedError, match="'pp' from tier 'gpu': it is pinned"):
        mgr.evict(p, "gpu").result(timeout=5)
    with pytest.raises(ValueError, match="'pp' from tier 'nvme': that is its home"):
        mgr.evict(p, "nvme")
    assert p.is_resident("gpu")


def test_evict_absent_copy_is_a_noop(mgr):
    p = mgr.create("p", 64, torch.float32, "nvme")
    mgr.evict(p, "gpu").result()
    assert mgr.stats()["evictions"] == 0


def test_lru_eviction_makes_room_for_a_new_fetch(mgr):
    # gpu budget 4 KiB = four 1 KiB partitions
    parts = [mgr.create(f"p{i}", 256, torch.float32, "nvme", init=rand(256, seed=i)) for i in range(6)]
    for p in parts[:4]:
        mgr.fetch(p, "gpu").result()
        mgr.release(p, "gpu")
    mgr.fetch(parts[0], "gpu").result()  # p0 is now the most recently used
    mgr.release(parts[0], "gpu")
    mgr.fetch(parts[4], "gpu").result()
    assert parts[1].state("gpu") is CopyState.ABSENT  # least recently used went first
    assert all(parts[i].is_resident("gpu") for i in (0, 2, 3, 4))
    assert mgr.resident_bytes("gpu") == 4096 and mgr.peak_bytes("gpu") == 4096
    assert torch.equal(mgr.fetch(parts[4], "gpu").result(), rand(256, seed=4))


def test_custom_policy_is_used(mgr):
    class Biggest:
        calls = 0

        def choose(self, tier, candidates, need_bytes):
            Biggest.calls += 1
            return sorted(candidates, key=lambda p: (-p.nbytes, p.name))

    mgr.set_eviction_policy("gpu", Biggest())
    small = mgr.create("small", 256, torch.float32, "nvme")
    big = mgr.create("big", 512, torch.float32, "nvme")
    new = mgr.create("new", 512, torch.float32, "nvme")
    for p in (big, small):
        mgr.prefetch(p, "gpu").result()
    mgr.prefetch(mgr.create("fill", 256, torch.float32, "nvme"), "gpu").result()  # gpu now full
    mgr.prefetch(new, "gpu").result()
    assert Biggest.calls >= 1
    assert big.state("gpu") is CopyState.ABSENT and small.is_resident("gpu")
    with pytest.raises(TypeError, match="choose"):
        mgr.set_eviction_policy("gpu", object())  # type: ignore[arg-type]
    mgr.set_eviction_policy("gpu", LRUPolicy())


def test_backpressure_waits_for_release_then_proceeds(mgr):
    a = mgr.create("a", 1024, torch.float32, "nvme")  # 4 KiB = the whole gpu budget
    b = mgr.create("b", 1024, torch.float32, "nvme", init=rand(1024))
    mgr.fetch(a, "gpu").result()
    fb = mgr.fetch(b, "gpu")
    with pytest.raises(TierTimeoutError, match="fetch of partition 'b' to tier 'gpu' did not finish"):
        fb.result(timeout=0.3)
    assert not fb.done()
    threading.Timer(0.05, mgr.release, args=(a, "gpu")).start()
    assert torch.equal(fb.result(timeout=10), rand(1024))
    assert a.state("gpu") is CopyState.ABSENT
    assert mgr.peak_bytes("gpu") == 4096
    assert mgr.stats()["stall_s"] > 0 and mgr.stats()["tiers"]["gpu"]["stall_s"] > 0


def test_backpressure_wait_honours_manager_timeout(tmp_path):
    with three_tier_manager(tmp_path, timeout_s=0.3) as m:
        a = m.create("a", 1024, torch.float32, "nvme")
        b = m.create("b", 1024, torch.float32, "nvme")
        m.fetch(a, "gpu").result()
        with pytest.raises(
            TierTimeoutError, match=r"partition 'b' \(4\.00 KiB\) waited 0\.3 s for room in tier 'gpu'"
        ):
            m.fetch(b, "gpu").result(timeout=10)
        assert b.state("gpu") is CopyState.ABSENT
        assert m.resident_bytes("gpu") == 4096  # b's attempt left no reservation behind


def test_concurrent_fetches_share_one_move(mgr):
    backend(mgr, "nvme").faults.delay_s = 0.05
    p = mgr.create("p", 256, torch.float32, "nvme", init=rand(256))
    futs = [mgr.fetch(p, "gpu") for _ in range(5)]
    ts = [f.result() for f in futs]
    assert all(t.data_ptr() == ts[0].data_ptr() for t in ts)
    assert p.pin_count("gpu") == 5
    assert mgr.stats()["links"]["nvme->gpu"]["ops"] == 1
    assert mgr.resident_bytes("gpu") == 1024


def test_drop_deletes_everywhere_and_returns_budget(mgr, tmp_path):
    p = mgr.create("p", 256, torch.float32, "nvme", init=rand(256))
    mgr.prefetch(p, "cpu").result()
    t = mgr.fetch(p, "gpu").result()
    with pytest.raises(PinnedError, match="'p': still pinned"):
        mgr.drop(p).result()
    mgr.release(p, "gpu")
    del t
    mgr.drop(p).result()
    assert not (tmp_path / "nvme" / "p").exists()
    assert all(mgr.resident_bytes(t) == 0 for t in mgr.tier_names)
    with pytest.raises(ValueError, match="'p' is not managed here"):
        mgr.fetch(p, "gpu")
    mgr.create("p", 8, torch.float32, "cpu")  # the name is free again


def test_stats_are_json_and_trace_has_one_event_per_move(mgr, tmp_path):
    p = mgr.create("p", 256, torch.float32, "nvme", init=rand(256))
    mgr.fetch(p, "gpu").result().add_(1)
    mgr.mark_dirty(p, "gpu")
    mgr.release(p, "gpu")
    mgr.evict(p, "gpu").result()
    s = json.loads(json.dumps(mgr.stats()))
    assert set(s["tiers"]) == {"gpu", "cpu", "nvme"}
    assert {"budget_bytes", "resident_bytes", "peak_bytes", "reads", "writes", "stall_s"} <= set(
        s["tiers"]["gpu"]
    )
    assert s["tiers"]["gpu"]["budget_bytes"] == 4096 and s["tiers"]["gpu"]["peak_bytes"] == 1024
    assert s["links"]["nvme->gpu"]["bytes"] == 1024 and s["links"]["gpu->nvme"]["bytes"] == 1024
    assert s["links"]["nvme->gpu"]["seconds"] > 0 and s["links"]["nvme->gpu"]["gbps"] > 0
    ev = mgr.trace_events()
    assert [(e["name"], e["cat"], e["ph"], e["args"]["bytes"]) for e in ev] == [
        ("p", "nvme->gpu", "X", 1024),
        ("p", "gpu->nvme", "X", 1024),
    ]
    assert ev[0]["ts"] <= ev[1]["ts"] and ev[0]["dur"] >= 0
    path = tmp_path / "trace.json"
    mgr.write_trace(path)
    doc = json.loads(path.read_text())
    assert len([e for e in doc["traceEvents"] if e["ph"] == "X"]) == 2


def test_write_trace_without_recording_is_an_error(tmp_path):
    with TierManager([Tier("cpu", MemBackend())]) as m:
        with pytest.raises(ValueError, match="record_trace=True"):
            m.write_trace(tmp_path / "t.json")


def test_manager_rejects_bad_tier_lists(tmp_path):
    b = MemBackend()
    with pytest.raises(ValueError, match="share one backend"):
        TierManager([Tier("gpu", b), Tier("cpu", b)])
    with pytest.raises(ValueError, match="'cpu' appears twice"):
        TierManager([Tier("cpu", MemBackend()), Tier("cpu", MemBackend())])
    with pytest.raises(ValueError, match="budget_bytes must be a non-negative int"):
        Tier("cpu", MemBackend(), -1)
    with pytest.raises(TypeError, match="StorageBackend"):
        Tier("cpu", object())  # type: ignore[arg-type]


def test_close_is_idempotent_and_later_calls_fail_clearly(tmp_path):
    m = three_tier_manager(tmp_path)
    p = m.create("p", 8, torch.float32, "nvme")
    m.close()
    m.close()
    from tiered.tiers import ManagerClosedError

    with pytest.raises(ManagerClosedError, match="closed"):
        m.fetch(p, "gpu")


def test_close_cancels_work_in_flight(tmp_path):
    m = three_tier_manager(tmp_path, timeout_s=0.5)
    a = m.create("a", 1024, torch.float32, "nvme")
    b = m.create("b", 1024, torch.float32, "nvme")
    m.fetch(a, "gpu").result()
    fb = m.fetch(b, "gpu")  # waits for room that never comes
    m.close()
    from tiered.tiers import ManagerClosedError

    with pytest.raises(ManagerClosedError, match="cancelled"):
        fb.result(timeout=5)


def test_verify_detects_corrupt_file(tmp_path):
    with three_tier_manager(tmp_path, verify=True) as m:
        p = m.create("p", 256, torch.float32, "nvme", init=rand(256))
        assert p.checksum("nvme") is not None
        f = tmp_path / "nvme" / "p"
        data = bytearray(f.read_bytes())
        data[17] ^= 0xFF
        f.write_bytes(bytes(data))
        with pytest.raises(
            StorageIOError,
            match=r"fetch of partition 'p' in tier 'nvme'.*checksum mismatch reading into tier 'gpu'",
        ):
            m.fetch(p, "gpu").result(timeout=5)
        assert p.state("gpu") is CopyState.ABSENT and m.resident_bytes("gpu") == 0
    # without verify the same corruption goes unnoticed (the check is what catches it)
    with three_tier_manager(tmp_path / "b", verify=False) as m:
        p = m.create("p", 256, torch.float32, "nvme", init=rand(256))
        f = tmp_path / "b" / "nvme" / "p"
        data = bytearray(f.read_bytes())
        data[17] ^= 0xFF
        f.write_bytes(bytes(data))
        assert not torch.equal(m.fetch(p, "gpu").result(timeout=5), rand(256))


def test_checksum_updated_on_write_back(tmp_path):
    with three_tier_manager(tmp_path, verify=True) as m:
        p = m.create("p", 64, torch.float32, "nvme", init=rand(64))
        c0 = p.checksum("nvme")
        m.fetch(p, "gpu").result().fill_(1.5)
        m.mark_dirty(p, "gpu")
        assert p.checksum("nvme") is None  # the stored bytes are stale now
        m.release(p, "gpu")
        m.evict(p, "gpu").result()
        assert p.checksum("nvme") not in (None, c0)
        assert torch.equal(m.fetch(p, "cpu").result(), torch.full((64,), 1.5))


def test_tier_future_completed_helper():
    f = TierFuture.completed(3)
    assert f.done() and f.result() == 3 and f.exception() is None


def test_unbounded_budget_uses_backend_capacity(tmp_path):
    class Small(DiskBackend):
        def capacity(self):
            from tiered.storage.base import Capacity

            return Capacity(total_bytes=2048, free_bytes=1000)

    with TierManager([Tier("cpu", MemBackend()), Tier("disk", Small(tmp_path))]) as m:
        assert m.budget_bytes("disk") == 1000 and m.budget_bytes("cpu") is None
        with pytest.raises(CapacityError, match="tier 'disk'"):
            m.create("p", 256, torch.float32, "disk")  # 1024 > 1000


def test_close_closes_backends_unless_told_not_to(tmp_path):
    class Closable(MemBackend):
        closed = 0

        async def close(self):
            Closable.closed += 1

    m = TierManager([Tier("cpu", Closable())])
    m.close()
    m.close()
    assert Closable.closed == 1
    m = TierManager([Tier("cpu", Closable())])
    m.create("p", 4, torch.float32, "cpu")
    m.close(close_backends=False)
    assert Closable.closed == 1
