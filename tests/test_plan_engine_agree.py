"""[Note: one memory model]: what `tiered plan` predicts for a config is what the engine's
pre-flight check counts when it builds that config, on a zoo of model shapes (meta device,
small, so the engine can be built here too)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import tiered
from tiered.config.loader import load_config
from tiered.planning.needs import predict
from tiered.planning.search import candidate_config

transformers = pytest.importorskip("transformers")


def _llama(**kw: Any) -> Any:
    base = dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    return transformers.LlamaConfig(**{**base, **kw})


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
        knobs,
        precision=precision,
        accumulation=1,
        nvme_path=str(tmp_path),
        budgets={"gpu": None, "cpu": None},
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
    pred = predict(planned, load_config(copy.deepcopy(config), model=planned), gpu_is_host=True)
    with tiered.initialize(built, config) as engine:
        measured = engine.capacity
    assert pred.needs == measured
    # the zoo is not trivial: optimizer state homed off the gpu, a pipeline counted
    opt_tier = "nvme" if placement == "all-nvme" else "cpu"
    assert pred.needs[opt_tier]["homes"] > 0
    if placement == "all-nvme":
        assert pred.needs["cpu"]["pipeline"] > 0


@pytest.mark.slow
def test_36b_128k_vocab_headline_fits_64gb_with_tiled_staging() -> None:
    """issue 21: the 36.3B Llama with a 128k vocabulary at 80 GB GPU / 64 GB host / 4 TB NVMe,
    through the engine's own planner: a config fits, its budgets are within what was given, and
    the staging is a few GB where holding the 4 largest groups whole would need ~46 GB."""
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
    result = search(model, Memories(gpu=80 * 10**9, cpu=64 * 10**9, nvme=4 * 10**12))
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
    assert needs["cpu"]["pipeline"] < 10e9  # the untiled staging of the 4 largest groups: ~46 GB
