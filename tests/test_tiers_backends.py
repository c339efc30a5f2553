"""TierManager over the real built-in backends, reached only through tiered.open_backend."""

from __future__ import annotations

import torch

import tiered
from tiered.tiers import CopyState, Tier, TierManager


def test_manager_over_real_gpu_cpu_nvme_backends(tmp_path):
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    tiers = [
        Tier("gpu", tiered.open_backend({"type": "gpu"}), 64 * 1024),
        Tier("cpu", tiered.open_backend({"type": "cpu", "pin_memory": False}), 128 * 1024),
        Tier("nvme", tiered.open_backend({"type": "nvme", "path": str(nvme_dir)}), None),
    ]
    g = torch.Generator().manual_seed(0)
    with TierManager(tiers, verify=True, record_trace=True) as m:
        want = {}
        parts = []
        for i in range(12):  # 12 x 16 KiB: more than the gpu (4) and cpu (8) budgets hold
            want[i] = torch.randn(4096, generator=g)
            parts.append(m.create(f"w{i}", 4096, torch.float32, "nvme", init=want[i]))
        assert {f.name for f in nvme_dir.iterdir() if f.name.startswith("w")} >= {f"w{i}" for i in range(12)}
        for rnd in range(2):
            for i, p in enumerate(parts):
                m.prefetch(p, "cpu")
                t = m.fetch(p, "gpu").result()
                assert torch.equal(t.cpu(), want[i]), (rnd, i)
                if i % 3 == 0:  # every third partition is updated: must survive eviction to nvme
                    t.add_(1.0)
                    want[i] = want[i] + 1.0
                    m.mark_dirty(p, "gpu")
                m.release(p, "gpu")
                assert m.resident_bytes("gpu") <= 64 * 1024 and m.resident_bytes("cpu") <= 128 * 1024
        m.flush().result()
        for i, p in enumerate(parts):
            assert p.state("nvme") is CopyState.VALID
            assert torch.equal(m.fetch(p, "cpu").result().cpu(), want[i])
            m.release(p, "cpu")
        s = m.stats()
        assert s["writebacks"] >= 4 and s["clean_drops"] >= 1
        assert s["tiers"]["gpu"]["peak_bytes"] <= 64 * 1024
        assert s["links"]["nvme->cpu"]["bytes"] > 0
        for p in parts:
            m.drop(p).result()
        assert not any(f.name.startswith("w") for f in nvme_dir.iterdir())
        assert all(m.resident_bytes(t) == 0 for t in m.tier_names)
