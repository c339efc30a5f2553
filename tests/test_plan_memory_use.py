"""Every byte given is used by the plan: the GPU's room beyond the working set ([Note: the GPU's
room searched]) and what more memory would buy ([Note: what more memory buys])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

from tiered.planning.more_memory import what_more_memory_buys
from tiered.planning.search import Memories, Pinned, search

transformers = pytest.importorskip("transformers")

STATE_ON_NVME = Pinned({"offload_optimizer": "nvme", "offload_param": "cpu", "grad_tier": "nvme"})


def _model() -> torch.nn.Module:
    with torch.device("meta"):  # ~0.45B: its fp32 Adam state (5.4 GB) is far more than the host given
        return transformers.AutoModelForCausalLM.from_config(
            small_llama_config(
                hidden_size=1024,
                intermediate_size=4096,
                num_hidden_layers=24,
                num_attention_heads=16,
                num_key_value_heads=16,
                vocab_size=32000,
            )
        )


def _disk(c: Any) -> int:
    return c.traffic["disk->host"] + c.traffic["host->disk"]


@pytest.mark.parametrize("activations", [0, None])
def test_the_gpus_room_steps_a_share_of_the_state_there(tmp_path: Path, activations: int | None) -> None:
    """State homed on NVMe, a GPU with room: a share of the state is stepped on the GPU (ratio < 1),
    its NVMe reads and writes saved; with the activations unknown, only half of the room is used."""
    model = _model()
    gpu = 4 * 10**9
    mem = Memories(gpu=gpu, cpu=3 * 10**9, nvme=10**12, activations=activations)
    result = search(model, mem, STATE_ON_NVME, nvme_path=str(tmp_path))
    best = result.best
    assert best is not None
    ratio = best.config["zero_optimization"]["offload_optimizer"].get("ratio")
    assert ratio is not None and 0 < ratio < 1, best.config["zero_optimization"]
    grid = [c for c in result.weighed if c.fits and c.knobs.get("ratio") is None]
    plain = min(grid, key=lambda c: c.seconds_per_step)  # the grid's best, the GPU's room idle
    assert best.seconds_per_step < plain.seconds_per_step
    assert _disk(best) < _disk(plain)
    room = gpu - plain.peaks["device"]
    used = best.peaks["device"] - plain.peaks["device"]
    if activations is None:  # the other half is theirs; the gpu budget written says so
        assert 0 < used <= room // 2
        assert best.config["tiered"]["tiers"]["gpu"]["budget"] <= plain.peaks["device"] + room // 2 + 1
        assert best.config["tiered"]["residency"] == "host"
    else:
        assert room // 2 < used <= room


def test_a_ratio_the_user_gives_is_the_only_one(tmp_path: Path) -> None:
    model = _model()
    pinned = Pinned({**STATE_ON_NVME.values, "ratio": 1.0})
    mem = Memories(gpu=4 * 10**9, cpu=3 * 10**9, nvme=10**12, activations=0)
    best = search(model, mem, pinned, nvme_path=str(tmp_path)).best
    assert best is not None
    assert "ratio" not in best.config["zero_optimization"]["offload_optimizer"]


def test_what_more_host_memory_buys_down_to_nothing_on_nvme(tmp_path: Path) -> None:
    model = _model()
    mem = Memories(gpu=4 * 10**9, cpu=3 * 10**9, nvme=10**12, activations=0)
    result = search(model, mem, nvme_path=str(tmp_path))
    assert result.best is not None and _disk(result.best) > 0
    lines = what_more_memory_buys(result)
    host = [m for m in lines if m.memory == "cpu" and not m.nothing_on_disk]
    assert [m.bytes for m in host] == [mem.cpu + int(mem.cpu * f) for f in (0.25, 0.5, 1.0)]
    times = [result.best.seconds_per_step] + [m.best.seconds_per_step for m in host if m.best]
    assert times == sorted(times, reverse=True) and times[-1] < times[0]  # more host, faster
    for m in host:  # each line is a config that fits the memory it names
        assert m.best is not None and m.best.peaks["host"] <= m.bytes
    (off,) = [m for m in lines if m.nothing_on_disk]
    assert off.best is not None and _disk(off.best) == 0 and off.bytes == off.best.peaks["host"] > mem.cpu
    assert off.saved_seconds == pytest.approx(result.best.seconds_per_step - off.best.seconds_per_step)
    assert {m.memory for m in lines} == {"cpu", "gpu"}


def test_tiered_plan_prints_what_more_memory_would_buy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tiered.cli.main import main

    args = ["plan", "--params", "0.3B", "--gpu-mem", "4GB", "--cpu-mem", "3GB", "--nvme-mem", "1TB"]
    assert main([*args, "--nvme-path", str(tmp_path / "nv")]) == 0
    out = capsys.readouterr().out
    assert "what more memory would buy" in out and "nothing moved on NVMe" in out
    assert "of the GPU's room beyond the working set is left to them" in out  # the assumption, said


def test_the_engine_runs_the_share_the_plan_steps_on_the_gpu(tmp_path: Path) -> None:
    """The config the search writes with a ratio is one the engine builds as predicted and trains."""
    import copy

    import tiered

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(small_llama_config(num_hidden_layers=4))
    mem = Memories(gpu=12 * 2**20, cpu=2 * 2**30, nvme=10**10, activations=0)
    pinned = Pinned({**STATE_ON_NVME.values, "sub_group_size": 100_000})
    best = search(model, mem, pinned, nvme_path=str(tmp_path)).best
    assert best is not None and best.prediction is not None
    ratio = best.config["zero_optimization"]["offload_optimizer"].get("ratio")
    assert ratio is not None and ratio < 1
    config = copy.deepcopy(best.config)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    real = transformers.AutoModelForCausalLM.from_config(model.config)
    with tiered.initialize(real, config) as engine:
        assert engine.capacity == best.prediction.needs
        ids = torch.randint(0, 512, (1, 16))
        for _ in range(2):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        assert torch.isfinite(loss)
        on_gpu = [og for og in engine.optimizer.groups if og.plan.side == "gpu"]
        assert on_gpu  # the share the plan put there is stepped there
