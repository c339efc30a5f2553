"""Gradients homed on NVMe (``tiered.grad_tier: "nvme"``, [Note: gradients on nvme]): training
equals plain PyTorch AdamW to 1e-5, with and without clipping and accumulation."""

from __future__ import annotations

import pytest
import torch
from engine_support import (
    CASES,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    make_batches,
    reference_train,
    tiered_train,
)

import tiered


@pytest.mark.parametrize(
    ("name", "gas", "clip"), [("mlp", 1, 0.0), ("mlp", 1, 0.05), ("mlp", 3, 0.05), ("llama", 2, 0.05)]
)
def test_nvme_gradients_equal_plain_adamw(tmp_path, name, gas, clip):
    case = CASES[name]
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), gas=gas, clip=clip)
    cfg["tiered"] = {"grad_tier": "nvme"}
    batches = make_batches(case, steps=3, micro=4, gas=gas)
    ref_losses, ref_state = reference_train(build(case), case, batches, lr=1e-3, clip=clip, gas=gas)
    losses, state, stats = tiered_train(build(case), case, batches, cfg)
    assert_losses_close(losses, ref_losses)
    assert_params_close(state, ref_state, rel=1e-5)
    assert stats["tiers"]["links"]["nvme->cpu"]["bytes"] > 0


@pytest.mark.parametrize(("name", "gas"), [("llama", 1), ("branch", 2)])
def test_overlapped_step_with_nvme_gradients_equals_plain_adamw(tmp_path, name, gas):
    """tiered.overlap_step_with_backward with the gradients on NVMe: each group's gradient is
    written home at its flush and its step starts from there while backward goes on; the result
    equals plain PyTorch AdamW, and bitwise the same placement stepped after backward (with
    accumulation, and with an untaken branch whose group is stepped at engine.step())."""
    case = CASES[name]
    batches = make_batches(case, steps=3, micro=4, gas=gas)
    ref_losses, ref_state = reference_train(build(case), case, batches, lr=1e-3, gas=gas)
    runs = {}
    for overlap in (True, False):
        cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / f"n{overlap}"), gas=gas)
        # the gradients' round trip through NVMe is what is compared: nothing kept in memory
        cfg["tiered"] = {"grad_tier": "nvme", "overlap_step_with_backward": overlap, "residency": "off"}
        runs[overlap] = tiered_train(build(case), case, batches, cfg)
    losses, state, stats = runs[True]
    assert stats["optimizer"]["total"]["overlapped_steps"] == 3
    assert stats["optimizer"]["last_step"]["groups_ready_in_backward"] > 0
    assert stats["tiers"]["links"]["cpu->nvme"]["bytes"] > 0
    assert_losses_close(losses, ref_losses)
    assert_params_close(state, ref_state, rel=1e-5)
    seq_losses, seq_state, seq_stats = runs[False]
    assert seq_stats["optimizer"]["total"]["overlapped_steps"] == 0
    assert seq_losses == losses
    for k, t in seq_state.items():
        assert torch.equal(state[k], t), k


@pytest.mark.parametrize("gas", [1, 3])
def test_a_fresh_gradient_is_not_read_from_nvme_before_it_is_overwritten(tmp_path, gas):
    """The first flush after zeroing writes every element of the staged gradient: it allocates
    the staging copy instead of reading the (stale) home copy. Later micro-batches of an
    accumulation window add to it, so they read it; the optimizer reads each gradient once."""
    case = CASES["mlp"]
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), gas=gas)
    cfg["tiered"] = {"grad_tier": "nvme"}
    batches = make_batches(case, steps=2, micro=4, gas=gas)
    with tiered.initialize(build(case), cfg) as engine:
        tm = engine.zero.tm
        grads = {g.grad.name for g in engine.zero.groups if g.grad is not None}
        reads: list[str] = []
        fetch = tm.fetch

        def counting_fetch(part, tier):
            if part.name in grads:
                reads.append(part.name)
            return fetch(part, tier)

        tm.fetch = counting_fetch
        per_step = []
        for i in range(0, len(batches), gas):
            before = len(reads)
            for b in batches[i : i + gas]:
                engine.backward(case.loss(engine(**b)))
                engine.step()
            per_step.append(len(reads) - before)
    # each step: (gas - 1) accumulating flushes + the optimizer's read, per gradient partition
    assert per_step == [len(grads) * gas] * 2


def test_gradient_partitions_live_on_nvme(tmp_path):
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"))
    cfg["tiered"] = {"grad_tier": "nvme"}
    with tiered.initialize(build(CASES["mlp"]), cfg) as engine:
        homes = {g.grad.home for g in engine.zero.groups if g.grad is not None}
        assert homes == {"nvme"}
        assert engine.zero.tm.resident_bytes("cpu") == 0  # no gradient bytes held in host memory


def test_grad_tier_needs_an_offloaded_optimizer(tmp_path):
    cfg = ds_config(param="nvme", nvme_path=str(tmp_path / "nvme"))
    cfg["tiered"] = {"grad_tier": "nvme"}
    with pytest.raises(tiered.ConfigError, match="tiered.grad_tier"):
        tiered.initialize(build(CASES["mlp"]), cfg)


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_plan_40b_on_64gb_host_recommends_nvme_gradients(capsys):
    """`tiered plan --params 40e9 --gpu-mem 80GB --cpu-mem 64GB --nvme-mem 4TB` fits only with the
    gradients on NVMe, and its printed config is one the engine accepts (tiered.grad_tier)."""
    import json

    from tiered.cli.main import main
    from tiered.config.loader import load_config

    args = [
        "plan",
        "--params",
        "40e9",
        "--gpu-mem",
        "80GB",
        "--cpu-mem",
        "64GB",
        "--nvme-mem",
        "4TB",
        "--json",
    ]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["recommended"]  # the search's fastest config that fits ([Note: config search])
    assert (best["offload_optimizer"], best["offload_param"], best["grad_tier"]) == ("nvme", "nvme", "nvme")
    cfg = doc["config"]
    assert cfg["tiered"]["grad_tier"] == "nvme"
    assert load_config(cfg).tiered.grad_tier == "nvme"
    # with the gradients pinned to host memory nothing fits 64 GB (they alone are 4 B x 40e9)
    assert main([*args, "--grad-tier", "cpu"]) == 1
    pinned = json.loads(capsys.readouterr().out)
    assert pinned["recommended"] is None and pinned["search"]["best"] is None
    assert pinned["search"]["closest"]["knobs"]["grad_tier"] == "cpu"


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_overlapped_step_consumes_gradients_from_memory(tmp_path, name):
    """[Note: gradient consumed from memory]: overlapped, without accumulation or clipping, each
    gradient is stepped from "cpu" and then dropped: neither written to NVMe nor read back. The
    bytes stats() reports saved are the measured difference of the links against the same run
    stepped after backward, and the results are bitwise that run's, equal to torch AdamW."""
    case = CASES[name]
    batches = make_batches(case, steps=3, micro=4)
    ref_losses, ref_state = reference_train(build(case), case, batches, lr=1e-3)
    runs = {}
    for overlap in (True, False):
        cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / f"n{overlap}"))
        # the gradients' round trip through NVMe is what is compared: nothing kept in memory
        cfg["tiered"] = {"grad_tier": "nvme", "overlap_step_with_backward": overlap, "residency": "off"}
        runs[overlap] = tiered_train(build(case), case, batches, cfg)
    (losses, state, stats), (seq_losses, seq_state, seq_stats) = runs[True], runs[False]
    consumed = stats["optimizer"]["grad_consumed_from_memory"]
    assert seq_stats["optimizer"]["grad_consumed_from_memory"] == {"group_steps": 0, "bytes_saved": 0}
    assert consumed["group_steps"] > 0 and consumed["group_steps"] % 3 == 0  # every group, every step
    links, seq_links = stats["tiers"]["links"], seq_stats["tiers"]["links"]
    written = seq_links["cpu->nvme"]["bytes"] - links["cpu->nvme"]["bytes"]
    read = seq_links["nvme->cpu"]["bytes"] - links["nvme->cpu"]["bytes"]
    assert read == consumed["bytes_saved"] // 2 > 0, (read, consumed)  # no gradient read back
    # no gradient written: on the MLP that is the whole difference of the two runs' writes; the
    # llama's two step orders (completion vs execution) also differ by 8 KiB of other writes
    assert written == read if name == "mlp" else written >= read, (written, read)
    assert seq_losses == losses
    for k, t in seq_state.items():
        assert torch.equal(state[k], t), k
    assert_losses_close(losses, ref_losses)
    assert_params_close(state, ref_state, rel=1e-5)


@pytest.mark.parametrize(
    ("grad_tier", "gas", "overlap", "home"),
    [
        ("nvme", 1, False, "gpu"),
        ("nvme", 2, True, "gpu"),
        ("nvme", 1, True, "nvme"),
        ("cpu", 1, False, "cpu"),
    ],
    ids=["nvme", "nvme-accumulated-overlapped", "nvme-consumed-from-memory", "cpu"],
)
def test_a_gpu_stepped_groups_gradient_stays_on_the_gpu_where_it_would_cross_storage(
    tmp_path, grad_tier, gas, overlap, home
):
    """[Note: a GPU-stepped gradient stays on the GPU]: with ``offload_optimizer.ratio`` 0.5 the
    groups the GPU kernel steps home their gradients in "gpu" where ``tiered.grad_tier`` is nvme
    and the gradient is not consumed from memory (no overlapped step, or accumulation), and in
    ``tiered.grad_tier`` otherwise; the engine's measured links equal its formula (which moves
    a gradient from its home), and training still equals torch AdamW."""
    import copy

    from tiered.config.loader import load_config
    from tiered.planning.needs import predict
    from tiered.planning.traffic import measured_per_step

    case = CASES["llama"]
    batches = make_batches(case, steps=3, micro=4, gas=gas)
    ref_losses, ref_state = reference_train(build(case), case, batches, lr=1e-3, gas=gas)
    cfg = ds_config(param="cpu", opt="nvme", nvme_path=str(tmp_path / "n"), gas=gas, ratio=0.5)
    cfg["tiered"] = {"grad_tier": grad_tier, "residency": "off", "overlap_step_with_backward": overlap}
    with tiered.initialize(build(case), cfg) as engine:
        losses = []
        for i, b in enumerate(batches):
            if i == gas:  # after the first step: its links are the window's start
                engine.optimizer.wait_writes()
                first = engine.tm.stats()["links"]
            loss = case.loss(engine(**b))
            losses.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        engine.optimizer.wait_writes()
        trainable = [g for g in engine.zero.groups if g.trainable]
        sides = [og.plan.side for og in engine.optimizer.groups]
        assert "gpu" in sides and "cpu" in sides, sides
        for g, side in zip(trainable, sides, strict=True):
            assert g.grad.home == (home if side == "gpu" else grad_tier), (g.name, side, g.grad.home)
        links = engine.tm.stats()["links"]
        window = {k: {"bytes": v["bytes"] - first.get(k, {"bytes": 0})["bytes"]} for k, v in links.items()}
        steps = len(batches) // gas - 1
        measured = measured_per_step(window, engine.parts.tier_memory, steps)
        formula = engine.stats()["bytes_per_step"]["formula"]
        assert measured == pytest.approx(formula), (measured, formula)
        # the plan's memory model homes them alike: its needs are the engine's
        pred = predict(build(case), load_config(copy.deepcopy(cfg)), gpu_is_host=True)
        assert pred.needs == engine.capacity
        state = {k: v.detach().float().clone() for k, v in engine.zero.gather_full_state_dict().items()}
    assert_losses_close(losses, ref_losses)
    assert_params_close(state, ref_state, rel=1e-5)
