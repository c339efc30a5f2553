"""[Note: one memory model]: what `tiered plan` predicts for a config is what the engine's
pre-flight check counts when it builds that config, on a zoo of model shapes (meta device,
small, so the engine can be built here too)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

import tiered
from tiered.config.loader import load_config
from tiered.engine.residency import tier_rooms
from tiered.planning.candidate import candidate_config, plan_base
from tiered.planning.needs import PEFT_IMPORT_BYTES, predict

transformers = pytest.importorskip("transformers")


_llama = small_llama_config


ZOO = {
    "llama-small-vocab": lambda: _llama(),
    "llama-128k-ratio-vocab": lambda: _llama(vocab_size=64 * 16),  # vocab / hidden as 128256 / 8192
    "llama-tied": lambda: _llama(tie_word_embeddings=True),
    "llama-gqa": lambda: _llama(num_key_value_heads=1),
    "mixtral-moe": lambda: transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
    ),
}
PLACEMENTS = {
    "opt-cpu": {"offload_optimizer": "cpu", "offload_param": "none", "grad_tier": "cpu"},
    "all-nvme": {"offload_optimizer": "nvme", "offload_param": "nvme", "grad_tier": "nvme"},
}


def _meta(config: Any, lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if lora:
        from tiered.finetune.lora import apply_lora, parse_lora_spec

        model = apply_lora(model, parse_lora_spec("r=4,targets=q_proj,v_proj"))
    return model


def _config(tmp_path: Path, placement: str, precision: str) -> dict[str, Any]:
    knobs = {
        **PLACEMENTS[placement],
        "sub_group_size": 5_000,  # below the largest parameters: the pipeline tile matters
        "buffer_count": 2,
        "persistence_threshold": 100,
        "max_in_cpu": 10_000,
    }
    cfg = candidate_config(
        knobs, plan_base(precision), nvme_path=str(tmp_path), budgets={"gpu": None, "cpu": None}
    )
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    return cfg


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("shape", [*ZOO, "llama-lora"])
def test_plan_equals_engine_preflight(tmp_path: Path, shape: str, placement: str, precision: str) -> None:
    lora = shape == "llama-lora"
    if lora:
        pytest.importorskip("peft")
    hf_config = ZOO["llama-small-vocab"]() if lora else ZOO[shape]()
    config = _config(tmp_path, placement, precision)
    planned = _meta(hf_config, lora)
    built = copy.deepcopy(planned)
    with tiered.initialize(built, config) as engine:
        measured = engine.capacity
        held = _backend_buffers(engine)
        host = engine.stats()["host_memory"]
        # the budgets as the engine's manager enforces them: a tier without one lends what its
        # backend reported free ([Note: residency])
        rooms = tier_rooms(engine.tm, engine.config, world_size=1)
        kept = engine.residency
    pred = predict(planned, load_config(copy.deepcopy(config), model=planned), gpu_is_host=True, rooms=rooms)
    assert pred.needs == measured
    assert pred.residency == kept
    # stats() reports the host peak the plan promised, term by term, beside the process's own
    assert host["planned_peak_bytes"] == pred.peak_bytes("host")
    assert (host["baseline"], host["outside_tiers"], host["backends"], host["imports"], host["live"]) == (
        pred.baseline_bytes,
        pred.outside_tiers_bytes,
        pred.backend_bytes,
        pred.imports_bytes,
        pred.live_bytes,
    )
    assert pred.imports_bytes == (PEFT_IMPORT_BYTES if lora else 0)  # peft: beyond the baseline
    assert host["tiers"] == pred.tier_bytes("host") and host["peak_rss_bytes"] > host["baseline"] / 2
    # host memory outside the tiers: the backends' own buffers are the ones the engine opened
    assert pred.backend_bytes == held
    assert pred.host_extra_bytes == (
        pred.baseline_bytes
        + pred.outside_tiers_bytes
        + sum(held.values())
        + pred.imports_bytes
        + pred.live_bytes
    )
    # the zoo is not trivial: optimizer state homed off the gpu, a pipeline counted
    opt_tier = "nvme" if placement == "all-nvme" else "cpu"
    assert pred.needs[opt_tier]["homes"] > 0
    if placement == "all-nvme":
        assert pred.needs["cpu"]["pipeline"] > 0
        assert held["nvme"] == 8 * 8 * 2**20  # DeepSpeed's aio defaults: 8 workers x 1 MiB x 8
    else:
        assert held == {}


def _backend_buffers(engine: Any) -> dict[str, int]:
    """Per tier, the bounce buffers its opened backend made (the nvme backend's, at first use)."""
    out = {}
    for name in engine.tm.tier_names:
        backend = engine.tm.tier(name).backend
        bounce = getattr(backend, "_bounce", None)
        if bounce is not None:
            out[name] = bounce.qsize() * backend.chunk_bytes
    return out


def test_process_baseline_is_per_device_kind(tmp_path: Path) -> None:
    """[Note: one memory model]: the host figure carries the process of the machine that runs it:
    measured for a CPU-only process, larger for a CUDA one (CUDA libraries, context, cuBLAS)."""
    from tiered.planning.needs import host_baseline_bytes

    model = _meta(ZOO["llama-small-vocab"](), lora=False)
    cfg = load_config(_config(tmp_path, "opt-cpu", "bf16"), model=model)
    on_cpu = predict(model, cfg, gpu_is_host=True)
    assert on_cpu.baseline_bytes == host_baseline_bytes("cpu") == 471 * 2**20
    on_cuda = predict(model, cfg, device_kind="cuda")
    assert on_cuda.baseline_bytes == host_baseline_bytes("cuda") == 1062 * 2**20
    # the kind is the process's, not the gpu tier's memory: a CPU-only plan with a device-memory gpu tier
    assert predict(model, cfg, device_kind="cpu").baseline_bytes == 471 * 2**20
    assert on_cuda.peak_bytes("host") - on_cuda.tier_bytes("host") == on_cuda.host_extra_bytes
    with pytest.raises(ValueError, match="'tpu'"):
        host_baseline_bytes("tpu")


def test_search_budgets_the_cpu_tier_from_the_device_kind_and_backend_buffers(tmp_path: Path) -> None:
    """The cpu tier's budget is cpu_mem less the process baseline of the machine, the transients
    and the nvme backend's bounce buffers, never more ([Note: config search])."""
    from tiered.planning.search import Memories, weigh

    model = _meta(ZOO["llama-small-vocab"](), lora=False)
    knobs = {
        **PLACEMENTS["all-nvme"],
        "sub_group_size": 5_000,
        "buffer_count": 2,
        "persistence_threshold": 100,
        "max_in_cpu": 0,
    }
    mem = Memories(gpu=2**30, cpu=2 * 2**30, nvme=2**30)
    budgets, others = {}, {}
    for kind in ("cpu", "cuda"):
        c = weigh(model, knobs, mem, nvme_path=str(tmp_path), max_in_cpu=0, device_kind=kind)
        assert c.prediction is not None and c.fits
        pred = c.prediction
        assert pred.backend_bytes == {"nvme": 64 * 2**20}
        budgets[kind] = c.config["tiered"]["tiers"]["cpu"]["budget"]
        # without a GPU the "gpu" tier, and the parameters the live budget keeps gathered there,
        # are host memory too: the cpu tier has what they leave
        other = sum(d["total"] for t, d in pred.needs.items() if t != "cpu" and pred.memory[t] == "host")
        assert (other > 0 and pred.live_bytes > 0) == (kind == "cpu")
        assert budgets[kind] == (
            mem.cpu - pred.baseline_bytes - pred.outside_tiers_bytes - 64 * 2**20 - pred.live_bytes - other
        )
        # homed on NVMe: the cpu tier caches up to its budget ([Note: a cpu tier caches up to its budget])
        assert pred.tier_bytes("host") < budgets[kind]
        assert c.peaks["host"] == pred.host_extra_bytes + other + budgets[kind] == mem.cpu
        others[kind] = other + pred.live_bytes
    # the baselines' difference, less what the gpu tier takes of host memory without a GPU
    assert budgets["cpu"] - budgets["cuda"] == (1062 - 471) * 2**20 - others["cpu"]


def test_backend_buffers_follow_the_tier_spec(tmp_path: Path) -> None:
    """A tier's backend options set its buffers: the nvme aio knobs, and wrappers (faults) and
    stripes (one nvme member per path) count their inner backends'."""
    from tiered.storage.registry import spec_host_buffer_bytes

    mib = 2**20
    d = str(tmp_path)
    assert spec_host_buffer_bytes({"type": "nvme", "path": d}) == 8 * 8 * mib
    assert spec_host_buffer_bytes({"type": "nvme", "path": d, "io_threads": 2, "chunk_bytes": mib}) == 2 * mib
    assert (
        spec_host_buffer_bytes({"type": "nvme", "path": d, "thread_count": 16, "queue_depth": 2})
        == 16 * 2 * mib
    )
    assert spec_host_buffer_bytes({"type": "nvme", "path": d, "intra_op_parallelism": 12}) == 12 * 8 * mib
    assert spec_host_buffer_bytes({"type": "faults", "inner": {"type": "nvme", "path": d}}) == 64 * mib
    stripe = {"type": "stripe", "paths": [f"{d}/a", f"{d}/b"], "member_options": {"io_threads": 2}}
    assert spec_host_buffer_bytes(stripe) == 2 * 2 * 8 * mib
    assert spec_host_buffer_bytes("cpu") == spec_host_buffer_bytes({"type": "gpu"}) == 0

    # the memory model counts a user's own tier by its spec, as the engine then opens it
    model = _meta(ZOO["llama-small-vocab"](), lora=False)
    config = _config(tmp_path, "all-nvme", "bf16")
    config["tiered"]["tiers"]["nvme"] = {
        "backend": {"type": "nvme", "path": d, "io_threads": 2, "chunk_bytes": mib}
    }
    pred = predict(model, load_config(copy.deepcopy(config), model=model), gpu_is_host=True)
    assert pred.backend_bytes == {"nvme": 2 * mib}
    with tiered.initialize(copy.deepcopy(model), config) as engine:
        assert _backend_buffers(engine) == pred.backend_bytes


def test_cpu_baseline_is_what_a_fresh_process_measures() -> None:
    """The "cpu" baseline against benchmarks/host_baseline.py's measurement, in a fresh
    interpreter (torch, transformers, tiered, the nvme backend, a meta Llama): within 25%, so a
    CUDA-sized constant (or a dependency that grew) is caught here."""
    import json
    import subprocess
    import sys

    from tiered.planning.needs import host_baseline_bytes

    if torch.cuda.is_available() or not Path("/proc/self/status").exists():
        pytest.skip("measures a CPU-only process's VmHWM from /proc")
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "host_baseline.py"), "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    measured = json.loads(p.stdout)["median_hwm_mib"] * 2**20
    assert 0.8 <= measured / host_baseline_bytes("cpu") <= 1.25, measured


@pytest.mark.slow
def test_36b_128k_vocab_headline_fits_64gb_with_tiled_staging(tmp_path: Path) -> None:
    """issue 21: the 36.3B Llama with a 128k vocabulary at 80 GB GPU / 64 GB host / 4 TB NVMe,
    through the engine's own planner: a config fits, its budgets are within what was given, and
    the staging is bounded by the tile, well below the largest groups held whole (~46 GB for
    the 4 largest)."""
    from tiered.planning.search import Memories, search

    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=40,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    result = search(model, Memories(gpu=80 * 10**9, cpu=64 * 10**9, nvme=4 * 10**12), nvme_path=str(tmp_path))
    best = result.best
    assert best is not None and best.prediction is not None
    tiers = best.config["tiered"]["tiers"]
    assert tiers["gpu"]["budget"] <= 80e9 and tiers["cpu"]["budget"] <= 64e9
    assert best.peaks["host"] <= 64e9
    needs = best.prediction.needs
    for name, spec in tiers.items():  # what the engine's check_capacity compares
        assert needs.get(name, {"total": 0})["total"] <= spec["budget"]
    largest = max(g.shard_numel for g in best.prediction.groups)
    assert largest > 1e9  # the embedding: larger than any tile
    # the states staged per tile; the largest groups' gradient (4 B) and bf16 parameter whole
    bc = best.knobs["buffer_count"]
    assert needs["cpu"]["pipeline"] <= bc * (best.knobs["sub_group_size"] * 12 + largest * 6)
    # against the same buffer_count of the largest group staged whole (state 12 B, gradient and
    # parameter 6 B per element): 18.9 GB a slot; the 4 largest groups whole: ~46 GB
    assert needs["cpu"]["pipeline"] < 0.5 * bc * largest * 18
