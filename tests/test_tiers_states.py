"""Copy-state transitions that only show up when operations overlap."""

from __future__ import annotations

import threading

import pytest
import torch
from tiers_support import backend, three_tier_manager

from tiered.tiers import CleanFirstLRUPolicy, CopyState


@pytest.fixture
def mgr(tmp_path):
    m = three_tier_manager(tmp_path, timeout_s=10.0)
    yield m
    m.close()


def test_a_write_during_a_load_is_not_lost(mgr):
    # the cpu load reads the old bytes from nvme slowly; meanwhile the gpu copy is rewritten.
    # The load must not land as a valid copy of the old bytes (see [Note: versions]).
    nv = backend(mgr, "nvme")
    p = mgr.create("p", 64, torch.float32, "nvme", init=torch.zeros(64))
    nv.faults.delay_s = 0.2
    f = mgr.prefetch(p, "cpu")
    buf = mgr.allocate(p, "gpu").result()
    buf.fill_(7.0)
    mgr.release(p, "gpu")
    f.result()
    assert torch.equal(mgr.fetch(p, "cpu").result(), torch.full((64,), 7.0))
    assert p.state("nvme") is CopyState.STALE and p.dirty_in() >= {"gpu"}
    nv.faults.delay_s = 0.0
    mgr.flush().result()
    mgr.release(p, "cpu")
    for t in ("gpu", "cpu"):
        mgr.evict(p, t).result()
    assert torch.equal(mgr.fetch(p, "cpu").result(), torch.full((64,), 7.0))


def test_a_stale_pinned_copy_is_freed_on_release(mgr):
    p = mgr.create("p", 256, torch.float32, "nvme")
    mgr.fetch(p, "gpu").result()
    c = mgr.fetch(p, "cpu").result()
    c.fill_(1.0)
    mgr.mark_dirty(p, "cpu")
    assert p.state("gpu") is CopyState.STALE and mgr.resident_bytes("gpu") == 1024
    mgr.release(p, "gpu")
    mgr.flush().result()  # a round trip through the loop: the free has run by now
    assert p.state("gpu") is CopyState.ABSENT and mgr.resident_bytes("gpu") == 0
    assert backend(mgr, "gpu").held_bytes == 0


def test_dirty_copies_travel_and_one_write_back_cleans_all(mgr):
    p = mgr.create("p", 64, torch.float32, "nvme")
    g = mgr.fetch(p, "gpu").result()
    g.fill_(2.0)
    mgr.mark_dirty(p, "gpu")
    mgr.prefetch(p, "cpu").result()  # copied from the dirty gpu copy: dirty as well
    assert p.dirty_in() == frozenset({"gpu", "cpu"})
    mgr.release(p, "gpu")
    mgr.evict(p, "gpu").result()  # another dirty copy stays and carries the write-back: a free drop
    assert p.dirty_in() == frozenset({"cpu"}) and p.state("nvme") is CopyState.STALE
    assert mgr.stats()["links"].get("gpu->nvme", {}).get("bytes", 0) == 0
    mgr.evict(p, "cpu").result()  # the last dirty copy: written back once
    assert p.dirty_in() == frozenset() and p.state("nvme") is CopyState.VALID
    s = mgr.stats()
    assert s["writebacks"] == 1 and s["clean_drops"] == 1
    assert torch.equal(mgr.fetch(p, "cpu").result(), torch.full((64,), 2.0))


def test_clean_first_policy_drops_clean_copies_before_dirty_ones(mgr):
    mgr.set_eviction_policy("gpu", CleanFirstLRUPolicy())
    dirty = mgr.create("dirty", 512, torch.float32, "nvme")
    clean = mgr.create("clean", 512, torch.float32, "nvme")
    mgr.allocate(dirty, "gpu").result().fill_(1.0)  # oldest use, but dirty
    mgr.release(dirty, "gpu")
    mgr.prefetch(clean, "gpu").result()
    mgr.prefetch(mgr.create("new", 512, torch.float32, "nvme"), "gpu").result()
    assert clean.state("gpu") is CopyState.ABSENT and dirty.is_resident("gpu")
    assert mgr.stats()["writebacks"] == 0


def test_many_threads_fetching_one_partition_share_the_move_and_pins_balance(mgr):
    backend(mgr, "nvme").faults.delay_s = 0.05
    p = mgr.create("p", 256, torch.float32, "nvme", init=torch.arange(256.0))
    out = []

    def worker():
        t = mgr.fetch(p, "gpu").result()
        out.append(bool(torch.equal(t, torch.arange(256.0))))
        mgr.release(p, "gpu")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert out == [True] * 8
    assert p.pin_count("gpu") == 0
    assert mgr.stats()["links"]["nvme->gpu"]["ops"] == 1


def test_discard_drops_a_dirty_copy_without_its_write_back(mgr):
    # [Note: discarded copies]: the home keeps the bytes it stored, which are the value again
    p = mgr.create("p", 64, torch.float32, "nvme", init=torch.full((64,), 3.0))
    c = mgr.allocate(p, "cpu").result()
    c.fill_(5.0)
    mgr.release(p, "cpu")
    assert p.state("nvme") is CopyState.STALE and p.dirty_in() == {"cpu"}
    writes = mgr.stats()["links"].get("cpu->nvme", {}).get("bytes", 0)
    mgr.discard(p, "cpu").result()
    assert p.state("cpu") is CopyState.ABSENT and p.valid_in() == {"nvme"}
    assert mgr.stats()["links"].get("cpu->nvme", {}).get("bytes", 0) == writes  # nothing written
    assert mgr.resident_bytes("cpu") == 0
    assert torch.equal(mgr.fetch(p, "cpu").result(), torch.full((64,), 3.0))
    mgr.release(p, "cpu")
    with pytest.raises(ValueError, match="its home"):
        mgr.discard(p, "nvme")
    # a clean copy is dropped as by evict
    mgr.discard(p, "cpu").result()
    assert p.state("cpu") is CopyState.ABSENT
