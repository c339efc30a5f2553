"""[Note: compute memory on a CPU-only machine]: where the run's compute is the CPU, the
activations the search is told about are host memory: added to the host figure and taken off the
cpu tier's budget, not off the gpu tier's; on a CUDA machine they stay the GPU's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import small_llama_config

from tiered.planning.search import Memories, weigh

transformers = pytest.importorskip("transformers")

CPU_OPT = {
    "offload_optimizer": "cpu",
    "offload_param": "none",
    "grad_tier": "cpu",
    "sub_group_size": 100_000_000,
    "buffer_count": 2,
    "persistence_threshold": 100_000,
    "max_in_cpu": 0,
}
ACT = 96 * 2**20


def _meta() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(small_llama_config())


def _budget(c: Any, tier: str) -> int:
    return int(c.config["tiered"]["tiers"][tier]["budget"])


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_activations_are_host_memory_where_the_compute_is_the_cpu(kind: str, tmp_path: Any) -> None:
    model = _meta()
    mem = Memories(gpu=2**30, cpu=4 * 2**30, nvme=2**34)
    told = Memories(gpu=mem.gpu, cpu=mem.cpu, nvme=mem.nvme, activations=ACT)
    kw = dict(nvme_path=str(tmp_path), device_kind=kind, max_live=10**9)
    without = weigh(model, dict(CPU_OPT), mem, **kw)
    withact = weigh(model, dict(CPU_OPT), told, **kw)
    assert without.fits and withact.fits
    if kind == "cpu":
        assert withact.peaks["host"] == without.peaks["host"] + ACT
        assert withact.peaks["device"] == without.peaks["device"]
        assert _budget(withact, "cpu") == _budget(without, "cpu") - ACT
        assert _budget(withact, "gpu") == _budget(without, "gpu") == mem.gpu
    else:
        assert withact.peaks["host"] == without.peaks["host"]
        assert _budget(withact, "cpu") == _budget(without, "cpu")
        assert _budget(withact, "gpu") == mem.gpu - ACT
