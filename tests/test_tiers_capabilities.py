"""The tier manager honours what a backend declares: `max_concurrency` bounds the moves in flight
on its links; `alignment_bytes` aligns the buffers the manager itself hands to it."""

from __future__ import annotations

from pathlib import Path

import torch
from tiers_support import DiskBackend, MemBackend, backend

from tiered.storage.base import Capabilities, tensor_bytes
from tiered.tiers import Tier, TierManager


class LimitedDisk(DiskBackend):
    """A disk that declares how many requests it takes at once, and records alignment."""

    def __init__(self, root: Path, max_concurrency: int, alignment: int = 1) -> None:
        super().__init__(root)
        self.max_concurrency = max_concurrency
        self.alignment = alignment
        self.written_ptrs: list[int] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            persistent=True,
            memory_like=False,
            alignment_bytes=self.alignment,
            max_concurrency=self.max_concurrency,
        )

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        self.written_ptrs.append(tensor_bytes(tensor, what=key).data_ptr())
        await super().write(key, tensor)


def _peak_inflight(tmp_path: Path, declared: int) -> int:
    disk = LimitedDisk(tmp_path / f"d{declared}", declared)
    tiers = [Tier("cpu", MemBackend(), None), Tier("nvme", disk, None)]
    with TierManager(tiers, max_inflight_per_link=4, verify=False) as m:
        parts = [
            m.create(f"p{i}", 1024, torch.float32, "nvme", init=torch.full((1024,), float(i)))
            for i in range(12)
        ]
        disk.faults.delay_s = 0.05  # every request stays in flight long enough to overlap
        futs = [m.prefetch(p, "cpu") for p in parts]
        for f in futs:
            f.result()
        for i, p in enumerate(parts):
            assert torch.equal(m.fetch(p, "cpu").result(), torch.full((1024,), float(i)))
            m.release(p, "cpu")
        return backend(m, "nvme").faults.max_inflight


def test_declared_max_concurrency_bounds_the_moves_in_flight(tmp_path: Path) -> None:
    assert _peak_inflight(tmp_path, 0) == 4  # no limit declared: the manager's own bound
    assert _peak_inflight(tmp_path, 2) == 2
    assert _peak_inflight(tmp_path, 1) == 1


def test_partitions_created_without_a_value_reach_the_backend_aligned(tmp_path: Path) -> None:
    for align in (4096, 1 << 16):
        disk = LimitedDisk(tmp_path / f"a{align}", 0, alignment=align)
        with TierManager([Tier("cpu", MemBackend(), None), Tier("nvme", disk, None)], verify=False) as m:
            parts = [m.create(f"z{i}", 1000 + i, torch.float32, "nvme") for i in range(5)]
            assert len(disk.written_ptrs) == 5
            assert all(p % align == 0 for p in disk.written_ptrs), (
                align,
                [p % align for p in disk.written_ptrs],
            )
            for p in parts:
                assert torch.equal(m.fetch(p, "cpu").result(), torch.zeros(p.numel))
                m.release(p, "cpu")
