"""Hugging Face gradient checkpointing through tiered's ZeRO-3 hooks: the recomputation in
backward re-gathers offloaded parameters, and training equals plain PyTorch (with the same
checkpointing) in both torch modes, with parameters on cpu and on nvme; with LoRA (frozen base)
both modes."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import REL
from finetune_support import ds_config, write_model

from tiered.config import load_config
from tiered.finetune import (
    PackedBatches,
    TrainOptions,
    apply_lora,
    build_model,
    max_rel_diff,
    pack,
    parse_lora_spec,
    reference_train,
    resolve_model,
    train,
)
from tiered.finetune.activations import enable_gradient_checkpointing
from tiered.finetune.data_sources import Document


def _rows(seq: int = 16):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(0, 256, (seq * 12,), generator=g).tolist())
    return pack([Document(ids, ids, "x")], seq, "x")


def _count_layer_calls(model: torch.nn.Module) -> list[int]:
    calls = [0]
    # q_proj: torch stops a recomputation early once the last needed tensor is saved (down_proj's input)
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _run_pair(
    tmp_path: Path, model: torch.nn.Module, param: str, steps: int = 3
) -> tuple[Any, Any, list[int]]:
    ref = copy.deepcopy(model)
    calls = _count_layer_calls(model)
    cfg = load_config(ds_config(tmp_path / "nvme", param=param, opt="cpu"), model=model)
    rows = _rows()
    result = train(model, cfg, PackedBatches(rows, 2, seed=1), TrainOptions(steps=steps), keep_state=True)
    want_losses, want = reference_train(ref, cfg, PackedBatches(rows, 2, seed=1), steps)
    for a, b in zip(result.losses, want_losses, strict=True):
        assert math.isclose(a, b, rel_tol=REL), (result.losses, want_losses)
    diff, name = max_rel_diff(result.state or {}, want)
    assert diff <= REL, f"{name} differs by {diff:.3g}"
    return result, want, calls


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_checkpointed_training_equals_plain_pytorch(tmp_path: Path, param: str, reentrant: bool) -> None:
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=2)
    enable_gradient_checkpointing(model, reentrant=reentrant)
    result, _, calls = _run_pair(tmp_path, model, param)
    # checkpointing really ran: each micro-step ran the layer's forward twice (forward + recompute)
    assert calls[0] == 2 * 3
    links = result.stats["tiers"]["links"]
    assert links[f"{param}->gpu"]["bytes"] > 0  # the parameters were offloaded and re-gathered


def test_without_checkpointing_the_layer_runs_once(tmp_path: Path) -> None:
    # the counter above can tell: without checkpointing there is no recomputation
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=2)
    _, _, calls = _run_pair(tmp_path, model, "cpu")
    assert calls[0] == 3


def test_lora_with_reentrant_checkpointing_equals_plain_pytorch(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    model = apply_lora(
        build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=2),
        parse_lora_spec("r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj"),
    )
    enable_gradient_checkpointing(model, reentrant=True)
    result, want, calls = _run_pair(tmp_path, model, "nvme")
    assert calls[0] == 2 * 3
    lora_b = [n for n in want if "lora_B" in n]
    assert lora_b and all(float(want[n].abs().sum()) > 0 for n in lora_b)  # the adapters learned


def test_lora_with_non_reentrant_checkpointing_equals_plain_pytorch(tmp_path: Path) -> None:
    # torch's non-reentrant recomputation keeps the frozen base weights by reference; zero/ hands
    # it detached aliases ([Note: recomputed frozen parameters]), so this trains and matches
    pytest.importorskip("peft")
    model = apply_lora(
        build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=2),
        parse_lora_spec("r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj"),
    )
    enable_gradient_checkpointing(model, reentrant=False)
    result, want, calls = _run_pair(tmp_path, model, "nvme")
    assert calls[0] == 2 * 3
    lora_b = [n for n in want if "lora_B" in n]
    assert lora_b and all(float(want[n].abs().sum()) > 0 for n in lora_b)


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_non_reentrant_with_frozen_parameters_through_zero(tmp_path: Path, param: str) -> None:
    # frozen norm weights are saved by the multiplication as the Parameter itself (not a view)
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=2)
    for n, p in model.named_parameters():
        if "layernorm" in n:
            p.requires_grad_(False)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5 name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, _, calls = _run_pair(tmp_path, model, param, steps=2)
    assert calls[0] == 2 * 2


def test_cli_gradient_checkpointing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tiered.cli.main import main

    folder = write_model(tmp_path / "m")
    data = tmp_path / "d.txt"
    data.write_text("the fast place is small. " * 40)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(tmp_path / "nvme")))
    base = [
        "finetune",
        "--model",
        str(folder),
        "--config",
        str(cfg),
        "--data",
        str(data),
        "--seq-len",
        "16",
        "--steps",
        "2",
    ]
    assert main([*base, "--gradient-checkpointing", "--compare-torch"]) == 0
    out = capsys.readouterr().out
    assert "gradient checkpointing" in out and "checkpointed: layer inputs + one layer" in out
    assert float(out.split("max relative parameter difference: ")[1].split()[0]) <= REL
    assert main([*base, "--lora", "4", "--gradient-checkpointing"]) == 0  # non-reentrant with LoRA
    assert "gradient checkpointing" in capsys.readouterr().out
    assert main([*base, "--gradient-checkpointing-reentrant"]) == 2
    assert "--gradient-checkpointing-reentrant needs --gradient-checkpointing" in capsys.readouterr().err
