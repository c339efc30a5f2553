"""[Note: residency]: the faster tiers keep what their budgets have room for, so memory given
becomes fewer bytes moved, and nothing else changes.

The sweep of issue 41 at a small size: one model, one DeepSpeed JSON (parameters and gradients in
cpu memory, the AdamW state homed on NVMe), only ``tiered.tiers.cpu.budget`` changed from the
run's need (no room for the state) to the need plus the whole state. NVMe bytes per step are
``2 x max(0, state - room)`` (each byte not kept read and written once), the engine's own formula
and `tiered plan`'s prediction say the same, and the trained values are bitwise the same at every
budget (and equal plain PyTorch AdamW).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

import tiered
from tiered.planning.traffic import measured_per_step

transformers = pytest.importorskip("transformers")

STEPS = 4
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _config(nvme: Path, *, cpu_budget: int | None = None, residency: str | None = None, dtype: str = "fp32"):
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4096,  # tiles of 16 KiB per state: the kept set's granularity
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 2},
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    t: dict[str, Any] = {}
    if cpu_budget is not None:
        t["tiers"] = {"cpu": {"budget": cpu_budget}}
    if residency is not None:
        t["residency"] = residency
    if t:
        cfg["tiered"] = t
    return cfg


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(small_llama_config())


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (2, 16), generator=g) for _ in range(STEPS)]


def _state_and_need(tmp_path: Path) -> tuple[int, int]:
    """The bytes of optimizer state homed on NVMe, and the cpu tier's need without any of it."""
    with tiered.initialize(_model(), _config(tmp_path / "probe", residency="off")) as engine:
        state = sum(p.nbytes for p in engine.tm.partitions() if p.home == "nvme")
        need = int(engine.capacity["cpu"]["total"])
    return state, need


def _train(config: dict[str, Any]) -> dict[str, Any]:
    """STEPS steps; NVMe bytes per step over steps 2..STEPS (the first reads what is kept after)."""
    losses = []
    with tiered.initialize(_model(), config) as engine:
        for i, x in enumerate(_batches()):
            out = engine(input_ids=x, labels=x)
            losses.append(out.loss.item())
            engine.backward(out.loss)
            engine.step()
            engine.optimizer.wait_writes()
            engine.zero.wait_prefetches()
            if i == 0:
                first = engine.tm.stats()["links"]
        links = engine.tm.stats()["links"]
        window = {k: {"bytes": v["bytes"] - first.get(k, {"bytes": 0})["bytes"]} for k, v in links.items()}
        measured = measured_per_step(window, engine.parts.tier_memory, STEPS - 1)
        stats = engine.stats()
        not_kept = [p.nbytes for p in engine.tm.partitions() if p.home == "nvme" and not p.is_kept("cpu")]
        params = {k: v.clone() for k, v in engine.zero.gather_full_state_dict().items()}
    return {
        "losses": losses,
        "params": params,
        "nvme": measured["disk->host"] + measured["host->disk"],
        "formula": stats["bytes_per_step"]["formula"],
        "kept": stats["residency"]["cpu"]["state"],
        "smallest_not_kept": min(not_kept, default=0),
        "kept_evictions": stats["tiers"]["kept_evictions"],
    }


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for x in _batches():
        out = model(input_ids=x, labels=x)
        losses.append(out.loss.item())
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_nvme_bytes_per_step_fall_with_the_cpu_budget_and_nothing_else_changes(tmp_path: Path) -> None:
    state, need = _state_and_need(tmp_path)
    runs = {}
    for f in FRACTIONS:
        room = int(f * state)
        runs[f] = r = _train(_config(tmp_path / f"nvme{f}", cpu_budget=need + room))
        want = 2 * max(0, state - room)
        # the bytes: each state byte the cpu tier cannot keep is read and written once per step
        assert abs(r["nvme"] - want) <= 0.05 * want, (f, r["nvme"], want)
        # first-fit decreasing: what is left of the room is less than any state tile not kept
        assert r["kept"] <= room and (
            r["smallest_not_kept"] == 0 or room - r["kept"] < r["smallest_not_kept"]
        )
        # the engine's formula (and so tiered plan's) counts the same bytes
        formula = r["formula"]["disk->host"] + r["formula"]["host->disk"]
        assert abs(r["nvme"] - formula) <= 0.01 * max(formula, 1) + 1, (f, r["nvme"], formula)
        assert r["kept_evictions"] == 0, "a kept copy was pushed out: the plan's room was not there"
    assert runs[0.0]["nvme"] == 2 * state
    assert runs[1.0]["nvme"] == 0
    volumes = [runs[f]["nvme"] for f in FRACTIONS]
    assert volumes == sorted(volumes, reverse=True) and len(set(volumes)) == len(volumes)
    # bitwise the same training at every budget, and plain PyTorch AdamW's
    base = runs[0.0]
    for f in FRACTIONS[1:]:
        assert runs[f]["losses"] == base["losses"], f
        for name, t in runs[f]["params"].items():
            assert torch.equal(t, base["params"][name]), (f, name)
    want_losses, want = _reference()
    assert base["losses"] == pytest.approx(want_losses, rel=1e-5)
    for name, t in base["params"].items():
        assert torch.allclose(t, want[name], rtol=1e-5, atol=1e-7), name


def test_residency_off_moves_the_whole_state_whatever_the_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state, need = _state_and_need(tmp_path)
    with caplog.at_level(logging.INFO, logger="tiered.engine.residency"):
        caplog.clear()  # the probe engine above logs its own line where INFO is already on
        off = _train(_config(tmp_path / "off", cpu_budget=need + state, residency="off"))
    assert off["nvme"] == 2 * state and off["kept"] == 0
    said = {
        (r.relativeCreated, r.getMessage()) for r in caplog.records if "tiered.residency" in r.getMessage()
    }
    assert len(said) == 1 and "'off'" in next(iter(said))[1]  # honoured, and said once (one log call)


def test_a_budget_left_out_lends_the_machine_and_keeps_the_small_state_whole(tmp_path: Path) -> None:
    """No tiered section at all (an unchanged DeepSpeed config): the cpu tier lends what the host
    reports free, less its reserve, and a 0.2M-parameter model's state fits in that."""
    state, _ = _state_and_need(tmp_path)
    r = _train(_config(tmp_path / "implicit"))
    assert r["kept"] == state and r["nvme"] == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_checkpoint_moves_between_budgets_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    """Saved with the state kept in memory, loaded with it on NVMe (and the other way round),
    then trained on: the same bits as a run that never stopped."""
    state, need = _state_and_need(tmp_path)
    budgets = {"all": need + state, "none": need}
    batches = _batches()

    def run(cfg: dict[str, Any], xs: list[torch.Tensor], load: Path | None = None, save: Path | None = None):
        with tiered.initialize(_model(), cfg) as engine:
            if load is not None:
                engine.load_checkpoint(load)
            losses = []
            for x in xs:
                out = engine(input_ids=x, labels=x)
                losses.append(out.loss.item())
                engine.backward(out.loss)
                engine.step()
            if save is not None:
                engine.save_checkpoint(save)
            return losses, {k: v.clone() for k, v in engine.zero.gather_full_state_dict().items()}

    whole, want = run(_config(tmp_path / "u", cpu_budget=budgets["all"], dtype=dtype), batches)
    for first, second in (("all", "none"), ("none", "all")):
        ck = tmp_path / f"ck-{first}"
        a, _ = run(
            _config(tmp_path / f"a{first}", cpu_budget=budgets[first], dtype=dtype), batches[:2], save=ck
        )
        b, got = run(
            _config(tmp_path / f"b{first}", cpu_budget=budgets[second], dtype=dtype), batches[2:], load=ck
        )
        assert a + b == whole, (first, second)
        for name, t in got.items():
            assert torch.equal(t, want[name]), (first, second, name)


def _frozen_mlp_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(small_llama_config(num_hidden_layers=4))
    for name, p in model.named_parameters():
        if ".mlp." in name:
            p.requires_grad_(False)  # a frozen base, as LoRA's: never changed, never refreshed
    return model


def _gpu_run(gpu_budget: int | None, residency: str = "auto") -> dict[str, Any]:
    from tiered.zero.rereads import backward_rereads

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 100_000,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 40_000,  # each group released after use: read again in backward
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
        "tiered": {"residency": residency},
    }
    if gpu_budget is not None:
        cfg["tiered"]["tiers"] = {"gpu": {"budget": gpu_budget}}
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    with tiered.initialize(_frozen_mlp_llama(), cfg) as engine:
        for i in range(3):
            out = engine(input_ids=x, labels=x)
            losses.append(out.loss.item())
            engine.backward(out.loss)
            engine.step()
            engine.optimizer.wait_writes()
            engine.zero.wait_prefetches()
            if i == 0:
                first = engine.tm.stats()["links"].get("cpu->gpu", {"bytes": 0})["bytes"]
        copies = (engine.tm.stats()["links"]["cpu->gpu"]["bytes"] - first) / 2
        groups = engine.zero.groups
        gathered = [g for g in groups if not g.persistent]
        z = engine.config.zero
        again = backward_rereads(
            [g.shard_numel for g in gathered],
            [False] * len(gathered),
            z.max_live_parameters_numel,
            z.max_reuse_distance_numel,
        )
        # each gathered group once per forward (twice where the backward reads it again), each
        # persistent trainable one once after the step changed it, a persistent frozen one never
        expected = sum(g.param.nbytes * (2 if j in again else 1) for j, g in enumerate(gathered))
        expected += sum(g.param.nbytes for g in groups if g.persistent and g.trainable)
        return {
            "copies": copies,
            "expected": expected,
            "persistent_frozen": sum(g.param.nbytes for g in groups if g.persistent and not g.trainable),
            "frozen": sum(g.param.nbytes for g in groups if not g.trainable),
            # the working set: the tier's need and what the live budget keeps beyond the gather
            "need": int(engine.capacity["gpu"]["total"])
            + max(0, 40_000 * 4 - engine.capacity["gpu"]["gather"]),
            "losses": losses,
            "params": {k: v.clone() for k, v in engine.zero.gather_full_state_dict().items()},
        }


def test_a_gpu_budget_holds_frozen_groups_persistent_and_cuts_the_copies_to_it_in_proportion() -> None:
    """[Note: persistent by room], the gpu tier's analogue of the sweep ("gpu" is host memory here:
    the copies are memory copies, counted on the cpu->gpu link): a budget with room beyond the
    working set holds the frozen groups (then the trainable ones the backward reads again)
    persistent, and the copies per step fall by what they no longer gather."""
    base = _gpu_run(None)
    assert base["persistent_frozen"] == 0
    need, frozen = base["need"], base["frozen"]
    fractions = (0.0, 0.25, 0.5, 0.75, 1.0)
    runs = [_gpu_run(need + int(f * frozen)) for f in fractions]
    held = [r["persistent_frozen"] for r in runs]
    assert held[0] == 0 and held[-1] == frozen and len(set(held)) == len(held), held
    assert all(h <= f * frozen for h, f in zip(held, fractions, strict=True)), held
    copies = [r["copies"] for r in runs]
    assert copies == sorted(copies, reverse=True) and copies[-1] < 0.5 * copies[0], copies
    for r in runs:
        assert r["copies"] == pytest.approx(r["expected"], rel=0.05), (r["copies"], r["expected"])
        assert r["losses"] == base["losses"]
        for name, t in r["params"].items():
            assert torch.equal(t, base["params"][name]), name
    for mode in ("off", "host"):  # "host": the room is left to the activations (what a plan writes unknowing)
        off = _gpu_run(need + frozen, residency=mode)
        assert off["persistent_frozen"] == 0 and off["copies"] == pytest.approx(runs[0]["copies"], rel=0.05)
