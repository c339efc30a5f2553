"""[Note: bytes per step]: `engine.stats()["bytes_per_step"]` puts the floor next to what the tier
manager moved: in fp32 and bf16, with and without accumulation, with the step overlapped with
backward (gradients consumed from memory) or not, the writes are the formula's to 5 % and the
reads at most 5 % above it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

import tiered
from tiered.planning.candidate import candidate_config, plan_base
from tiered.planning.traffic import measured_per_step

transformers = pytest.importorskip("transformers")


def _engine(
    tmp_path: Path,
    place: tuple[str, str, str],
    precision: str,
    accumulation: int,
    overlap: bool,
    zero: dict[str, int] | None = None,
    *,
    cpu_budget: str | None = None,
    sub_group_size: int = 20_000,
    model: Any = None,
    max_in_cpu: int = 0,
) -> Any:
    knobs = {
        "offload_optimizer": place[0],
        "offload_param": place[1],
        "grad_tier": place[2],
        "sub_group_size": sub_group_size,
        "buffer_count": 2,
        "persistence_threshold": 100,
        "max_in_cpu": max_in_cpu,
    }
    cfg = candidate_config(
        knobs,
        plan_base(precision, accumulation),
        nvme_path=str(tmp_path),
        budgets={"gpu": None, "cpu": cpu_budget},
    )
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    cfg.setdefault("tiered", {})["overlap_step_with_backward"] = overlap
    cfg["zero_optimization"].update(zero or {})
    torch.manual_seed(0)
    if model is None:
        model = transformers.AutoModelForCausalLM.from_config(small_llama_config())
    return tiered.initialize(model, cfg)


def _floor_and_measured(
    engine: Any, accumulation: int, vocab: int = 512
) -> tuple[dict[str, int], dict[str, float]]:
    """The formula, and the links measured over steps 2 and 3 (after initialize's writes)."""
    x = torch.randint(0, vocab, (2, 16))
    with engine:
        snaps = []
        for _ in range(3):
            for _ in range(accumulation):
                out = engine(input_ids=x, labels=x)
                engine.backward(out.loss)
                engine.step()
            engine.optimizer.wait_writes()  # this step's write-backs counted in this step
            # and the next forward's first groups, which the step prefetches once it wrote them:
            # counted in the step that issued them, not on whichever side of the snapshot they land
            engine.zero.wait_prefetches()
            snaps.append(engine.tm.stats()["links"])
        stats = engine.stats()["bytes_per_step"]
        memory = engine.parts.tier_memory
    assert stats["steps"] == 3 and stats["measured"] is not None
    last = {k: {"bytes": v["bytes"] - snaps[0].get(k, {"bytes": 0})["bytes"]} for k, v in snaps[2].items()}
    floor = stats["formula"]
    assert floor["disk->host"] > 0 and floor["host->disk"] > 0
    return floor, measured_per_step(last, memory, 2)


def _assert_at_the_formula(floor: dict[str, int], measured: dict[str, float]) -> None:
    # writes: exactly the write-backs the formula counts (the gradient round trip only where the
    # step cannot consume it from memory)
    assert abs(measured["host->disk"] - floor["host->disk"]) <= 0.05 * floor["host->disk"], (floor, measured)
    # reads: parameters once per micro-batch (twice where backward re-reads), the optimizer state
    # once (in fp32 the master, which is the parameter, once more: the forward's copy is not kept
    # until the step). A group the step just wrote may still be resident when the next forward's
    # prefetch asks for it, saving a read the formula counts: up to 10 % below, at most 5 % above
    assert 0.90 * floor["disk->host"] <= measured["disk->host"] <= 1.05 * floor["disk->host"], (
        floor,
        measured,
    )


@pytest.mark.parametrize(
    ("accumulation", "overlap"), [(1, False), (1, True), (2, False)], ids=["a1", "a1-overlap", "a2"]
)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize(
    "place", [("nvme", "nvme", "cpu"), ("nvme", "nvme", "nvme")], ids=["opt+params", "all"]
)
def test_floor_next_to_measured(
    tmp_path: Path, place: tuple[str, str, str], precision: str, accumulation: int, overlap: bool
) -> None:
    engine = _engine(tmp_path, place, precision, accumulation, overlap)
    _assert_at_the_formula(*_floor_and_measured(engine, accumulation))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize(
    "zero",
    [{"stage3_max_live_parameters": 40_000}, {"stage3_max_reuse_distance": 0}],
    ids=["live-40k", "reuse-0"],
)
def test_the_formula_counts_the_backward_rereads_the_live_budget_causes(
    tmp_path: Path, precision: str, zero: dict[str, int]
) -> None:
    """A gpu tier that cannot keep every parameter from its forward to its backward use reads
    some twice: the formula replays the engine's keep rules (`backward_rereads`) and counts them."""
    place = ("nvme", "nvme", "cpu")
    _, unbounded = _floor_and_measured(_engine(tmp_path / "a", place, precision, 1, False), 1)
    floor, measured = _floor_and_measured(_engine(tmp_path / "b", place, precision, 1, False, zero), 1)
    assert measured["disk->host"] > 1.05 * unbounded["disk->host"], "the limit caused no re-reads"
    _assert_at_the_formula(floor, measured)


def test_a_cpu_tier_with_no_room_to_spare_still_consumes_every_gradient_from_memory(tmp_path: Path) -> None:
    """[Note: backward waits instead of parking]: gradients on NVMe, the step overlapped with
    backward, and a cpu tier of exactly the pipeline's staging bound: backward runs ahead of the
    stepper, and the kept gradients used to be written home to make room and read back by their
    step (on this model about a third of the group steps). Backward now waits for the stepper
    instead: every group step takes its gradient from memory and the NVMe traffic is the formula's."""
    from engine_support import tiny_llama

    engine = _engine(
        tmp_path,
        ("nvme", "nvme", "nvme"),
        "fp32",
        1,
        True,
        cpu_budget="64KiB",  # the pipeline bound of this model: no room beyond it
        sub_group_size=2000,
        model=tiny_llama(),
    )
    floor, measured = _floor_and_measured(engine, 1, vocab=64)
    opt = engine.stats()["optimizer"]
    groups = opt["groups_cpu"]
    assert groups > 1
    assert opt["grad_consumed_from_memory"]["group_steps"] == 3 * groups, opt
    _assert_at_the_formula(floor, measured)
    assert opt["grad_parked"]["parked_group_steps"] == 0, opt["grad_parked"]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_kept_gradients_leave_the_room_of_the_parameters_max_in_cpu_keeps(
    tmp_path: Path, precision: str
) -> None:
    """[Note: max_in_cpu] with [Note: backward waits instead of parking]: the new parameters kept
    in cpu after their step are room the kept gradients may not take. Taking it made the stepper's
    reads evict them: on the 1/20 headline replica (benchmarks/headline_replica.py) every kept
    parameter was written home and read back each step, 2.0 GB and 2.6 GB above the formula (9 and
    11 %), and the peak RSS 1.24x the plan; with the room left to them the replica's NVMe bytes are
    the formula's and its RSS 1.01x the plan (benchmarks/RESULTS.md). Here: the keeper's allowance
    leaves the pipeline's bound and every kept parameter, and training stays at the formula."""
    from engine_support import tiny_llama

    engine = _engine(
        tmp_path,
        ("nvme", "nvme", "nvme"),
        precision,
        1,
        True,
        cpu_budget="192KiB",  # the 64 KiB pipeline bound + every parameter (90.7 KB in fp32)
        sub_group_size=2000,
        model=tiny_llama(),
        max_in_cpu=10**9,
    )
    opt = engine.optimizer
    # [Note: residency]: parameters first (each saves its gathers' reads and its write-back)
    kept_params = sum(og.group.param.nbytes for og in opt.groups if og.group.param.is_kept("cpu"))
    assert kept_params == sum(og.group.param.nbytes for og in opt.groups) > 0  # every one kept
    kept = engine.tm.kept_bytes("cpu")
    assert kept == engine.residency.bytes_in("cpu") >= kept_params
    keeper = opt.keep_grads_in_memory()
    home = sum(p.nbytes for p in engine.tm.partitions() if p.home == "cpu")
    staging = opt.stage_bytes_needed()["cpu"]
    assert keeper.allowance == 192 * 1024 - home - staging - kept
    floor, measured = _floor_and_measured(engine, 1, vocab=64)
    stats = engine.stats()["optimizer"]
    assert stats["grad_parked"]["parked_group_steps"] == 0, stats["grad_parked"]
    _assert_at_the_formula(floor, measured)
