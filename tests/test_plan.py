"""The memory model of `tiered plan` ([Note: plan accounting])."""

from __future__ import annotations

import json

import pytest

from tiered.errors import ConfigError
from tiered.planning.accounting import (
    Memories,
    ModelShape,
    PlanOptions,
    PrecisionBytes,
    gb,
    model_state_bytes,
)
from tiered.planning.model_shape import parse_count, shape_from_params
from tiered.planning.verdict import make_plan

GB = 10**9


def test_zero_paper_figure_1_vector() -> None:
    # docs/architecture.md, "Memory model": Psi = 7.5B, N = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB.
    b = PrecisionBytes.of("bf16")
    got = [gb(model_state_bytes(stage, 7_500_000_000, 64, b)) for stage in (0, 1, 2, 3)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_plan_table_reports_the_paper_vector() -> None:
    plan = make_plan(shape_from_params("7.5e9"), Memories(), PlanOptions(world_size=64))
    states = {s.key: gb(s.bytes_on("gpu", working=False)) for s in plan.strategies}
    assert (states["dp"], states["zero1"], states["zero2"], states["zero3"]) == (120.0, 31.4, 16.6, 1.9)
    # Communication: 2 Psi elements of 2 B for DP..ZeRO-2, 3 Psi for ZeRO-3 (1.5x).
    comm = {s.key: s.comm_bytes_per_step for s in plan.strategies}
    assert comm["dp"] == comm["zero1"] == comm["zero2"] == 2 * 7_500_000_000 * 2
    assert comm["zero3"] == 3 * 7_500_000_000 * 2 == 1.5 * comm["dp"]


def test_fp32_accounting_is_4_4_8() -> None:
    b = PrecisionBytes.of("fp32")
    assert (b.param, b.grad, b.optimizer) == (4, 4, 8)
    assert model_state_bytes(0, 1000, 1, b) == 16_000
    assert model_state_bytes(3, 1000, 4, b) == 4_000
    plan = make_plan(shape_from_params(1000, largest_layer=10), Memories(), PlanOptions(precision="fp32"))
    # An offloaded optimizer keeps its own fp32 master: 12 B, plus 4 B fp32 gradients on the CPU.
    s = plan.strategy("zero3_opt_cpu")
    assert s.bytes_on("cpu") == 1000 * (12 + 4)
    assert s.bytes_on("gpu", working=False) == 1000 * 4


def test_40b_on_one_80gb_gpu_fits_only_with_nvme_offload() -> None:
    shape = shape_from_params("40B")
    assert shape.largest_layer_params == 800_000_000  # the stated 2 % assumption
    assert shape.persistent_params == 40_000_000  # the stated 0.1 % assumption
    plan = make_plan(shape, Memories(80 * GB, 512 * GB, 4000 * GB), PlanOptions(world_size=1))
    s = {x.key: x for x in plan.strategies}
    for key in ("dp", "zero1", "zero2"):
        assert s[key].bytes_on("gpu") == 640 * GB and not s[key].fits_all
    # ZeRO-3 without offload: 640 GB of model states + the 4.88 GB working set; no fit.
    working = (2 * 800_000_000 * 2) + 800_000_000 * 2 + 40_000_000 * 2
    assert working == 4_880_000_000
    assert s["zero3"].bytes_on("gpu") == 640 * GB + working and s["zero3"].fits["gpu"] is False
    # Optimizer on CPU: 80 GB of bf16 params stay on the GPU (+ working set > 80 GB);
    # CPU = 12 B optimizer + 4 B fp32 gradients = 640 GB > 512 GB.
    assert s["zero3_opt_cpu"].bytes_on("cpu") == 640 * GB
    assert s["zero3_opt_cpu"].shortfall_bytes == {"gpu": working, "cpu": 128 * GB}
    # Optimizer + params on CPU: 2 + 4 + 12 = 18 B per parameter = 720 GB > 512 GB.
    assert s["zero3_opt_param_cpu"].bytes_on("cpu") == 720 * GB
    assert s["zero3_opt_param_cpu"].shortfall_bytes == {"cpu": 208 * GB}
    # Optimizer on NVMe: params still 80 GB on the GPU.
    assert s["zero3_opt_nvme"].fits["gpu"] is False
    # Both on NVMe: NVMe = (2 + 12) B x 40e9 = 560 GB; CPU = 4 B fp32 grads (160 GB) + optimizer
    # staging 3 x 3 x 1e8 x 4 B (3.6 GB) + 5 parameter buffers x 0.8e9 x 2 B (8 GB); GPU = working set.
    both = s["zero3_opt_param_nvme"]
    assert both.bytes_on("nvme") == 560 * GB
    assert both.bytes_on("cpu") == 160 * GB + 3_600_000_000 + 8 * GB
    assert both.bytes_on("gpu") == working
    assert both.fits_all and both.fits == {"gpu": True, "cpu": True, "nvme": True}
    assert plan.recommended == "zero3_opt_param_nvme"
    assert "only with offload" in plan.message
    # Per-step traffic: NVMe reads+writes 24 B optimizer + 3 x 2 B params per parameter.
    assert both.nvme_io_bytes_per_step == 40 * GB * (24 + 6)
    assert both.comm_bytes_per_step == 0  # one rank: no collective


def test_recommended_config_is_deepspeed_stage3_with_tier_budgets() -> None:
    plan = make_plan(
        shape_from_params("40B"), Memories(80 * GB, 512 * GB, 4000 * GB), PlanOptions(nvme_path="/data/nvme")
    )
    cfg = plan.config
    assert cfg is not None
    json.dumps(cfg)  # JSON-able
    z = cfg["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_optimizer"]["device"] == "nvme" and z["offload_param"]["device"] == "nvme"
    assert z["offload_param"]["nvme_path"] == "/data/nvme"
    assert z["offload_param"]["buffer_size"] >= plan.shape.largest_layer_params
    assert cfg["bf16"] == {"enabled": True}
    tiers = cfg["tiered"]["tiers"]
    assert tiers["nvme"]["backend"] == {"type": "nvme", "path": "/data/nvme"}
    # Budgets: need + 10 %, whole GiB, capped at what the tier has.
    from tiered.units import parse_bytes

    for tier, have in (("gpu", 80 * GB), ("cpu", 512 * GB), ("nvme", 4000 * GB)):
        budget = parse_bytes(tiers[tier]["budget"])
        need = plan.strategy("zero3_opt_param_nvme").bytes_on(tier)
        assert need <= budget <= have


def test_cheapest_fit_order_prefers_no_offload_then_cpu() -> None:
    shape = shape_from_params("1B", largest_layer="20M")
    roomy = make_plan(shape, Memories(80 * GB, 512 * GB, None), PlanOptions())
    assert roomy.recommended == "zero3"
    assert "offload_optimizer" not in roomy.config["zero_optimization"]
    assert "without offload" in roomy.message
    # 16 GB of states do not fit 10 GB; optimizer on CPU leaves 2 GB params + working set.
    tight = make_plan(shape, Memories(10 * GB, 512 * GB, None), PlanOptions())
    assert tight.recommended == "zero3_opt_cpu"
    assert tight.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    # Memory not given is not checked, and the message says so.
    unknown = make_plan(shape, Memories(10 * GB, None, None), PlanOptions())
    assert unknown.recommended == "zero3_opt_cpu"
    assert "not checked: cpu" in unknown.message


def test_world_size_shards_every_offloaded_term() -> None:
    shape = ModelShape(8_000, 100, 0, "test")
    one = make_plan(shape, Memories(), PlanOptions(world_size=1)).strategy("zero3_opt_param_cpu")
    eight = make_plan(shape, Memories(), PlanOptions(world_size=8)).strategy("zero3_opt_param_cpu")
    assert one.bytes_on("cpu") == 8_000 * 18
    assert eight.bytes_on("cpu") == 1_000 * 18
    assert eight.comm_bytes_per_step == 3 * 8_000 * 2


def test_nothing_fits_says_by_how_much() -> None:
    plan = make_plan(shape_from_params("400B"), Memories(8 * GB, 64 * GB, 1000 * GB), PlanOptions())
    assert plan.recommended is None and plan.config is None
    assert plan.message.startswith("nothing fits")
    assert "short by" in plan.message and "GPU" in plan.message


def test_activation_memory_is_added_to_the_working_set() -> None:
    shape = ModelShape(10_000, 100, 10, "test")
    without = make_plan(shape, Memories(), PlanOptions()).strategy("zero3")
    with_act = make_plan(shape, Memories(), PlanOptions(activation_bytes=12345)).strategy("zero3")
    assert with_act.bytes_on("gpu", working=True) - without.bytes_on("gpu", working=True) == 12345


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40e9", 40 * 10**9),
        ("40B", 40 * 10**9),
        ("7.5e9", 7_500_000_000),
        ("7.5B", 7_500_000_000),
        ("350M", 350_000_000),
        ("1.5T", 1_500_000_000_000),
        ("125k", 125_000),
        (40_000, 40_000),
    ],
)
def test_parse_count(text: str | int, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("bad", ["abc", "-1", "", "0", "40Q", "nan"])
def test_parse_count_rejects_with_the_text(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_count(bad, what="--params")
    assert "--params" in str(info.value) and repr(bad) in str(info.value)


def test_bad_options_are_named() -> None:
    with pytest.raises(ConfigError, match="--world-size"):
        PlanOptions(world_size=0)
    with pytest.raises(ConfigError, match="--precision"):
        PlanOptions(precision="int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--largest-layer"):
        shape_from_params("1B", largest_layer="2B")
