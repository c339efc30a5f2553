"""LoRA through tiered: the --lora spec and its errors, training equal to plain PyTorch + peft
with the frozen base offloaded and never stepped, the CLI, and `tiered plan --lora`."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from engine_support import REL
from finetune_support import ds_config, write_model

from tiered.cli.main import main
from tiered.config import load_config
from tiered.errors import ConfigError
from tiered.finetune import (
    LoraSpec,
    PackedBatches,
    apply_lora,
    build_model,
    max_rel_diff,
    pack,
    parse_lora_spec,
    reference_train,
    resolve_model,
    train,
)
from tiered.finetune import TrainOptions as Opts
from tiered.finetune.data_sources import Document

pytest.importorskip("peft")


# ---- the spec --------------------------------------------------------------------------------------
def test_parse_full_spec_and_bare_rank() -> None:
    got = parse_lora_spec("r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj,o_proj")
    assert got == LoraSpec(16, 32.0, 0.05, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert parse_lora_spec("8") == LoraSpec(8)
    assert parse_lora_spec("targets=q_proj, v_proj ,r=4") == LoraSpec(4, targets=("q_proj", "v_proj"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("alpha=32", r"r \(the adapter rank\) is required"),
        ("r=16,rank=2", r"unknown key 'rank'; keys are r, alpha, dropout, targets"),
        ("r=sixteen", r"r='sixteen' is not an integer"),
        ("r=0", r"r must be >= 1"),
        ("r=4,,alpha=2", r"an empty item"),
        ("r=4,q_proj", r"'q_proj' is not key=value"),
        ("r=4,dropout=1.5", r"dropout must be in \[0, 1\)"),
        ("r=4,r=5", r"r given twice"),
        ("r=4,alpha=x", r"alpha='x' is not a number"),
    ],
)
def test_malformed_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_lora_spec(spec)


def test_unknown_targets_name_the_models_layers(tmp_path: Path) -> None:
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)))
    with pytest.raises(
        ConfigError,
        match=r"--lora targets qkv_proj: the model has no such modules; its linear "
        r"layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj",
    ):
        apply_lora(model, parse_lora_spec("r=4,targets=q_proj,qkv_proj"))


# ---- equivalence -----------------------------------------------------------------------------------
def _rows(seq: int = 16):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(0, 256, (seq * 12,), generator=g).tolist())
    return pack([Document(ids, ids, "x")], seq, "x")


@pytest.mark.parametrize(("param", "opt"), [("cpu", "cpu"), ("nvme", "nvme")])
def test_lora_through_tiered_equals_plain_pytorch_peft(tmp_path: Path, param: str, opt: str) -> None:
    folder = write_model(tmp_path / "m", tokenizer=False)
    spec = parse_lora_spec("r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj,down_proj")
    model = apply_lora(build_model(resolve_model(folder), seed=1), spec)
    ref = copy.deepcopy(model)
    base0 = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters0 and all("lora_" in n for n in adapters0)
    cfg = load_config(ds_config(tmp_path / "nvme", param=param, opt=opt), model=model)
    rows = _rows()
    result = train(model, cfg, PackedBatches(rows, 2, seed=3), Opts(steps=4), keep_state=True)
    want_losses, want = reference_train(ref, cfg, PackedBatches(rows, 2, seed=3), 4)
    for a, b in zip(result.losses, want_losses, strict=True):
        assert math.isclose(a, b, rel_tol=REL), (result.losses, want_losses)
    diff, name = max_rel_diff(result.state or {}, want)
    assert diff <= REL, f"{name} differs by {diff:.3g}"
    got = result.state or {}
    for n, t in base0.items():  # the frozen base never changes
        assert torch.equal(got[n], t), n
    moved = [n for n, t in adapters0.items() if not torch.equal(got[n], t)]
    assert len(moved) == len(adapters0)  # every adapter stepped (B from zero, A once B is nonzero)
    # the base stayed offloaded and got no optimizer state: only the adapters' groups are stepped
    zero, optim = result.stats["zero"], result.stats["optimizer"]
    assert optim["groups_cpu"] + optim["groups_gpu"] < zero["groups"]
    home = {"cpu": "cpu", "nvme": "nvme"}[param]
    assert result.stats["tiers"]["links"][f"{home}->gpu"]["bytes"] > 0


def test_cli_lora_reports_trainable_and_refuses_bad_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    assert main([*base, "--lora", "r=4,targets=q_proj,v_proj", "--compare-torch"]) == 0
    out = capsys.readouterr().out
    assert "trainable: LoRA r=4, alpha=peft default, dropout=peft default, targets=q_proj,v_proj" in out
    diff = float(out.split("max relative parameter difference: ")[1].split()[0])
    assert diff <= REL
    cfg.write_text(json.dumps(ds_config(tmp_path / "nvme2")))
    assert main([*base, "--lora", "r=4,targets=wq"]) == 2
    err = capsys.readouterr().err
    assert "--lora targets wq: the model has no such modules" in err and "q_proj" in err
    assert main([*base, "--lora", "r=4,size=2"]) == 2
    assert "unknown key 'size'" in capsys.readouterr().err
    assert not (tmp_path / "nvme2").exists()


# ---- tiered plan --lora ----------------------------------------------------------------------------
def test_plan_lora_counts_frozen_at_2_bytes_plus_adapter_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_model(tmp_path / "m", tokenizer=False)
    assert main(["plan", "--model", str(folder), "--json"]) in (0, 1)
    full = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", str(folder), "--lora", "r=4,targets=q_proj,v_proj", "--json"]) in (0, 1)
    lora = json.loads(capsys.readouterr().out)
    psi = full["model"]["total_params"]
    # q_proj 32->32, v_proj 32->16 (2 kv heads of 8) in 2 layers: r (in + out) each
    adapters = 2 * (4 * (32 + 32) + 4 * (32 + 16))
    assert lora["model"]["trainable_params"] == adapters
    assert lora["model"]["total_params"] == psi + adapters

    def state(plan: dict, key: str) -> int:  # type: ignore[type-arg]
        s = next(x for x in plan["strategies"] if x["key"] == key)
        return sum(t["bytes"] for t in s["terms"] if not t["what"].startswith("working:"))

    # ZeRO-3 on one rank, bf16: 2 B per frozen parameter + (2 + 2 + 12) B per adapter parameter
    assert state(lora, "zero3") == 2 * psi + 16 * adapters
    assert state(full, "zero3") == 16 * psi
    # the offloaded placements are the search's now (tests/test_plan_engine_agree.py's LoRA cases
    # hold them equal to the engine's own pre-flight)
    assert main(["plan", "--params", "7B", "--lora", "16"]) == 2
    assert "--lora needs --model" in capsys.readouterr().err
