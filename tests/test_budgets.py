"""Budgets are hard at every instant, under concurrent use from several threads (hypothesis)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tiers_support import DiskBackend, MemBackend, backend

from tiered.errors import CapacityError
from tiered.tiers import CopyState, Tier, TierManager

GPU, CPU = 2560, 6144  # bytes; partitions are 64..256 float32 (256 B .. 1 KiB)

op = st.one_of(
    st.tuples(st.just("fetch"), st.integers(0, 3), st.sampled_from(["gpu", "cpu"]), st.booleans()),
    st.tuples(st.just("prefetch"), st.integers(0, 3), st.sampled_from(["gpu", "cpu"])),
    st.tuples(st.just("evict"), st.integers(0, 3), st.sampled_from(["gpu", "cpu"])),
    st.tuples(st.just("allocate"), st.integers(0, 3), st.sampled_from(["gpu", "cpu"]), st.integers(-50, 50)),
    st.tuples(st.just("flush"), st.integers(0, 3)),
    st.tuples(st.just("shared"), st.integers(0, 1), st.sampled_from(["gpu", "cpu"])),
)


def _manager(tmp_path, n):
    return TierManager(
        [
            Tier("gpu", MemBackend(), GPU),
            Tier("cpu", MemBackend(), CPU),
            Tier("nvme", DiskBackend(tmp_path / f"n{n}")),
        ],
        timeout_s=30.0,
        max_inflight_per_link=2,
    )


_counter = iter(range(10**9))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(64, 256), min_size=8, max_size=8),
    homes=st.lists(st.sampled_from(["nvme", "nvme", "cpu"]), min_size=8, max_size=8),
    programs=st.lists(st.lists(op, max_size=25), min_size=3, max_size=3),
)
def test_budgets_hold_and_data_survives_under_concurrent_threads(tmp_path, sizes, homes, programs):
    # Every fetch the programs make must be possible: room for the largest partition beside the
    # cpu-homed ones (else CapacityError is the right answer, tested in test_tiers_errors).
    assume(sum(4 * n for n, h in zip(sizes, homes, strict=True) if h == "cpu") + 4 * max(sizes) <= CPU)
    m = _manager(tmp_path, next(_counter))
    try:
        # partitions 0..5: two private to each thread (written only by it); 6..7 shared, read-only
        want: dict[int, torch.Tensor] = {}
        parts = []
        for i in range(8):
            want[i] = torch.arange(sizes[i], dtype=torch.float32) + 1000 * i
            parts.append(m.create(f"p{i}", sizes[i], torch.float32, homes[i], init=want[i]))
        errors: list[BaseException] = []

        def run(tid: int, prog: list[tuple]) -> None:
            try:
                for o in prog:
                    kind = o[0]
                    if kind == "shared":
                        p = parts[6 + o[1]]
                        t = m.fetch(p, o[2]).result()
                        assert torch.equal(t, want[6 + o[1]]), f"shared p{6 + o[1]} corrupt in {o[2]}"
                        m.release(p, o[2])
                        continue
                    i = 2 * tid + (o[1] % 2)
                    p = parts[i]
                    if kind == "fetch":
                        t = m.fetch(p, o[2]).result()
                        assert torch.equal(t, want[i]), f"p{i} corrupt in {o[2]} after {o}"
                        if o[3]:
                            t.add_(1.0)
                            want[i] = want[i] + 1.0
                            m.mark_dirty(p, o[2])
                        m.release(p, o[2])
                    elif kind == "prefetch":
                        m.prefetch(p, o[2]).result()
                    elif kind == "evict":
                        if o[2] != p.home:
                            m.evict(p, o[2]).result()
                    elif kind == "allocate":
                        t = m.allocate(p, o[2]).result()
                        t.fill_(float(o[3]))
                        want[i] = torch.full((p.numel,), float(o[3]))
                        m.release(p, o[2])
                    elif kind == "flush":
                        m.flush(p).result()
            except BaseException as exc:  # noqa: BLE001 - reported below, with the op that failed
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(tid, prog)) for tid, prog in enumerate(programs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads), "a worker thread hung"
        assert not errors, errors[0]

        # hard budgets, checked against what the backends really held at their worst instant
        assert backend(m, "gpu").max_held_bytes <= GPU
        assert backend(m, "cpu").max_held_bytes <= CPU
        assert m.peak_bytes("gpu") <= GPU and m.peak_bytes("cpu") <= CPU
        # and the manager's books match the backends' after everything settled
        m.flush().result()
        assert m.resident_bytes("gpu") == backend(m, "gpu").held_bytes
        assert m.resident_bytes("cpu") == backend(m, "cpu").held_bytes
        assert all(not p.pins() and not p.dirty_in() for p in parts)
        for i, p in enumerate(parts):
            assert p.state(p.home) is CopyState.VALID
            for t in ("gpu", "cpu"):
                if t != p.home:
                    m.evict(p, t).result()
            assert torch.equal(m.fetch(p, "cpu").result(), want[i]), f"p{i} lost its last write"
            m.release(p, "cpu")
        home_cpu = sum(p.nbytes for p in parts if p.home == "cpu")
        gpu_left = sum(p.nbytes for p in parts if p.is_resident("gpu"))
        assert m.resident_bytes("gpu") == gpu_left == 0
        cpu_cached = sum(p.nbytes for p in parts if p.home != "cpu" and p.state("cpu").resident)
        assert m.resident_bytes("cpu") == home_cpu + cpu_cached
    finally:
        m.close()


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(512, 4096),
    homes=st.lists(st.integers(16, 512), max_size=6),
    request=st.integers(16, 1200),
)
def test_capacity_error_exactly_when_a_request_can_never_fit(tmp_path_factory, budget, homes, request):
    tmp = tmp_path_factory.mktemp("cap")
    with TierManager([Tier("gpu", MemBackend(), budget), Tier("nvme", DiskBackend(tmp))], timeout_s=5) as m:
        home_bytes = 0
        for i, n in enumerate(homes):
            if home_bytes + 4 * n <= budget:
                m.create(f"h{i}", n, torch.float32, "gpu")
                home_bytes += 4 * n
            else:
                with pytest.raises(CapacityError, match=f"partition 'h{i}'"):
                    m.create(f"h{i}", n, torch.float32, "gpu")
        assert m.resident_bytes("gpu") == home_bytes  # home partitions count for their lifetime
        p = m.create("req", request, torch.float32, "nvme")
        if 4 * request > budget - home_bytes:
            with pytest.raises(CapacityError, match="can never fit tier 'gpu'"):
                m.fetch(p, "gpu").result(timeout=5)
            assert m.resident_bytes("gpu") == home_bytes
        else:
            m.fetch(p, "gpu").result(timeout=5)
            assert m.resident_bytes("gpu") == home_bytes + 4 * request <= budget


def test_per_link_concurrency_is_bounded(tmp_path):
    nv = DiskBackend(tmp_path)
    with TierManager([Tier("cpu", MemBackend()), Tier("nvme", nv)], max_inflight_per_link=2) as m:
        parts = [m.create(f"p{i}", 64, torch.float32, "nvme") for i in range(8)]
        nv.faults.delay_s = 0.03
        futs = [m.prefetch(p, "cpu") for p in parts]
        for f in futs:
            f.result(timeout=30)
        assert nv.faults.max_inflight == 2  # reached, never exceeded
        link = m.stats()["links"]["nvme->cpu"]
        assert link["max_inflight"] == 2 and link["ops"] == 8
        # union of busy intervals, not the sum: 8 ops of >= 30 ms, 2 at a time
        assert link["seconds"] >= 4 * 0.03


def test_pinned_partitions_block_until_release_from_another_thread(tmp_path):
    with TierManager(
        [Tier("gpu", MemBackend(), 2048), Tier("nvme", DiskBackend(tmp_path))], timeout_s=30
    ) as m:
        a, b, c = (m.create(n, 256, torch.float32, "nvme") for n in "abc")
        m.fetch(a, "gpu").result()
        m.fetch(b, "gpu").result()  # gpu full of pinned bytes
        fc = m.fetch(c, "gpu")
        time.sleep(0.1)
        assert not fc.done() and c.state("gpu") is CopyState.LOADING
        assert m.resident_bytes("gpu") == 2048
        threading.Thread(target=m.release, args=(b, "gpu")).start()
        fc.result(timeout=10)
        assert b.state("gpu") is CopyState.ABSENT and a.is_resident("gpu") and c.is_resident("gpu")
        assert backend(m, "gpu").max_held_bytes <= 2048
