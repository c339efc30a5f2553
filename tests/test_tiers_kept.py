"""Kept copies: a faster tier caches a partition across uses ([Note: kept copies])."""

from __future__ import annotations

import pytest
import torch
from tiers_support import backend, three_tier_manager

from tiered.tiers import CopyState, LRUPolicy


@pytest.fixture
def mgr(tmp_path):
    m = three_tier_manager(tmp_path, cpu_bytes=4096)
    yield m
    m.close()


def _link(mgr, name):
    return mgr.stats()["links"].get(name, {"bytes": 0, "ops": 0})


def _home_values(mgr, name):
    return torch.frombuffer(bytearray(backend(mgr, "nvme").path(name).read_bytes()), dtype=torch.float32)


def _update(mgr, part, tier, value):
    """What the optimizer does to a state tile: fetch, write in place, mark dirty, release, settle."""
    t = mgr.fetch(part, tier).result()
    t.fill_(value)
    mgr.mark_dirty(part, tier)
    mgr.release(part, tier)
    mgr.settle(part, tier).result()


def test_a_kept_copy_stays_dirty_across_uses_and_home_is_neither_read_nor_written_again(mgr):
    p = mgr.create("state", 256, torch.float32, "nvme")  # 1 KiB
    mgr.keep(p, "cpu")
    assert p.kept_in() == frozenset({"cpu"})
    for step in range(1, 6):
        _update(mgr, p, "cpu", float(step))
    # one read (the first fetch), no write-back: the newest bytes live only in cpu
    assert _link(mgr, "nvme->cpu")["bytes"] == 1024
    assert _link(mgr, "cpu->nvme")["bytes"] == 0
    assert p.state("cpu") is CopyState.DIRTY and p.state("nvme") is CopyState.STALE
    assert mgr.stats()["tiers"]["cpu"]["kept_bytes"] == 1024
    assert mgr.stats()["tiers"]["cpu"]["kept_resident_bytes"] == 1024
    # flush (a checkpoint's or close's) writes it home once and leaves it resident, clean
    mgr.flush(p).result()
    assert _link(mgr, "cpu->nvme")["bytes"] == 1024
    assert p.state("cpu") is CopyState.VALID and p.state("nvme") is CopyState.VALID
    assert torch.equal(_home_values(mgr, "state"), torch.full((256,), 5.0))


def test_settle_evicts_and_writes_back_a_copy_that_is_not_kept(mgr):
    p = mgr.create("state", 256, torch.float32, "nvme")
    for step in range(1, 4):
        _update(mgr, p, "cpu", float(step))
    assert _link(mgr, "nvme->cpu")["bytes"] == 3 * 1024
    assert _link(mgr, "cpu->nvme")["bytes"] == 3 * 1024
    assert p.state("cpu") is CopyState.ABSENT and p.state("nvme") is CopyState.VALID


def test_a_clean_kept_copy_is_never_rewritten(mgr):
    p = mgr.create("param", 256, torch.float32, "nvme", init=torch.ones(256))
    mgr.keep(p, "cpu")
    for _ in range(4):  # read-only uses (a frozen parameter's gathers)
        mgr.fetch(p, "cpu").result()
        mgr.release(p, "cpu")
        mgr.settle(p, "cpu").result()
    assert _link(mgr, "nvme->cpu")["bytes"] == 1024
    assert _link(mgr, "cpu->nvme")["bytes"] == 0
    assert p.state("cpu") is CopyState.VALID


def test_under_pressure_copies_that_are_not_kept_go_first_whatever_the_policy_prefers(mgr):
    mgr.set_eviction_policy("cpu", LRUPolicy())
    kept = mgr.create("kept", 512, torch.float32, "nvme")  # 2 KiB of the 4 KiB budget
    mgr.keep(kept, "cpu")
    _update(mgr, kept, "cpu", 7.0)  # the least recently used copy from here on
    other = mgr.create("other", 256, torch.float32, "nvme")
    mgr.prefetch(other, "cpu").result()  # 1 KiB, clean, used after the kept one
    third = mgr.create("third", 256, torch.float32, "nvme")
    mgr.prefetch(third, "cpu").result()  # 1 KiB: the budget is full now
    fourth = mgr.create("fourth", 256, torch.float32, "nvme")
    mgr.fetch(fourth, "cpu").result()  # needs 1 KiB: LRU alone would take the kept copy
    mgr.release(fourth, "cpu")
    assert kept.state("cpu") is CopyState.DIRTY, "the kept copy was evicted while others could go"
    assert other.state("cpu") is CopyState.ABSENT
    assert mgr.stats()["kept_evictions"] == 0
    assert _link(mgr, "cpu->nvme")["bytes"] == 0


def test_a_kept_copy_evicted_when_nothing_else_can_go_is_written_home_first(mgr):
    kept = mgr.create("kept", 768, torch.float32, "nvme")  # 3 KiB of the 4 KiB budget
    mgr.keep(kept, "cpu")
    _update(mgr, kept, "cpu", 3.0)
    big = mgr.create("big", 512, torch.float32, "nvme")  # 2 KiB: only the kept copy can make room
    t = mgr.fetch(big, "cpu").result()
    assert kept.state("cpu") is CopyState.ABSENT and kept.state("nvme") is CopyState.VALID
    assert mgr.stats()["kept_evictions"] == 1
    assert torch.equal(_home_values(mgr, "kept"), torch.full((768,), 3.0))
    mgr.release(big, "cpu")
    del t
    # still kept: the next use brings it back and it stays again
    _update(mgr, kept, "cpu", 4.0)
    assert kept.state("cpu") is CopyState.DIRTY


def test_keep_refuses_a_home_or_a_tier_without_resident_tensors(mgr):
    p = mgr.create("p", 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="that is its home"):
        mgr.keep(p, "cpu")
    q = mgr.create("q", 16, torch.float32, "gpu")
    with pytest.raises(ValueError, match="not memory-like"):
        mgr.keep(q, "nvme")
    with pytest.raises(ValueError, match="that is its home"):
        mgr.settle(p, "cpu")


def test_keep_can_be_undone_and_the_copy_then_goes_at_the_next_settle(mgr):
    p = mgr.create("state", 256, torch.float32, "nvme")
    mgr.keep(p, "cpu")
    _update(mgr, p, "cpu", 1.0)
    mgr.keep(p, "cpu", False)
    assert p.kept_in() == frozenset()
    _update(mgr, p, "cpu", 2.0)
    assert p.state("cpu") is CopyState.ABSENT
    assert torch.equal(_home_values(mgr, "state"), torch.full((256,), 2.0))
