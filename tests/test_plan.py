"""`tiered plan`'s two parts: the ZeRO paper's table ([Note: the ZeRO paper's table]), an
explanatory view whose bytes per parameter come from the engine's own code, and the search
([Note: config search]), which alone decides, counting every config with the engine's memory
model ([Note: one memory model])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

from tiered.config.loader import load_config
from tiered.errors import ConfigError
from tiered.planning.candidate import plan_base
from tiered.planning.model_shape import parse_count
from tiered.planning.search import Memories, Pinned, search, shortfall_text, weigh
from tiered.planning.zero_table import PaperBytes, gb, model_state_bytes, zero_table

transformers = pytest.importorskip("transformers")
GB = 10**9


def _meta(**kw: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(small_llama_config(**kw))


CPU_OPTIMIZER = {
    "offload_optimizer": "cpu",
    "offload_param": "none",
    "grad_tier": "cpu",
    "sub_group_size": 10**9,
    "buffer_count": 4,
    "persistence_threshold": 0,
}


def _paper(precision: str) -> PaperBytes:
    return PaperBytes.of(plan_base(precision).cfg)


def test_zero_paper_figure_1_vector() -> None:
    # docs/architecture.md, "Memory model": Psi = 7.5B, N = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB.
    b = _paper("bf16")
    assert (b.param, b.grad, b.per_param()["optimizer"]) == (2, 2, 12)
    got = [gb(model_state_bytes(stage, 7_500_000_000, 64, b)) for stage in (0, 1, 2, 3)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_plan_table_reports_the_paper_vector() -> None:
    rows = {r.key: r for r in zero_table(7_500_000_000, 64, _paper("bf16"))}
    assert [gb(rows[k].gpu_bytes) for k in ("dp", "zero1", "zero2", "zero3")] == [120.0, 31.4, 16.6, 1.9]
    # Communication: 2 Psi elements of 2 B for DP..ZeRO-2, 3 Psi for ZeRO-3 (1.5x), none on one rank.
    comm = {k: r.comm_bytes_per_step for k, r in rows.items()}
    assert comm["dp"] == comm["zero1"] == comm["zero2"] == 2 * 7_500_000_000 * 2
    assert comm["zero3"] == 3 * 7_500_000_000 * 2 == 1.5 * comm["dp"]
    assert all(r.comm_bytes_per_step == 0 for r in zero_table(7_500_000_000, 1, _paper("bf16")))
    # the GPU given: what each row lacks of it
    assert rows["dp"].shortfall(80 * GB) == 40 * GB and rows["zero3"].shortfall(80 * GB) == 0
    assert rows["dp"].to_json(80 * GB)["shortfall_bytes"] == {"gpu": 40 * GB}


def test_fp32_bytes_are_4_4_8_and_a_compressed_state_format_shrinks_k() -> None:
    b = _paper("fp32")
    assert (b.param, b.grad, b.optimizer(1000)) == (4, 4, 8000)  # the fp32 parameter is the master
    assert model_state_bytes(0, 1000, 1, b) == 16_000
    assert model_state_bytes(3, 1000, 4, b) == 4_000
    # K is the engine's own state format: bf16 moments are 2 + 2 B beside the 4 B master
    cfg = load_config({"bf16": {"enabled": True}, "tiered": {"optimizer_state_format": "bf16"}})
    assert PaperBytes.of(cfg).per_param() == {"param": 2, "grad": 2, "optimizer": 8}


def test_lora_rows_count_frozen_parameters_at_p_bytes() -> None:
    rows = {r.key: r for r in zero_table(10_000, 4, _paper("bf16"), trainable=1_000)}
    assert rows["zero3"].gpu_bytes == (16 * 1_000 + 2 * 9_000) // 4
    assert rows["dp"].gpu_bytes == 16 * 1_000 + 2 * 9_000


def test_the_offloaded_placements_are_the_engine_memory_models_not_formulas(tmp_path: Path) -> None:
    """fp32, optimizer on the CPU: the engine keeps a separate fp32 master (12 B) and fp32
    gradients (4 B) there, the parameters (4 B) on the GPU: what the paper's accounting said, now
    read from the prediction of the config the search writes."""
    model = _meta()
    psi = sum(p.numel() for p in model.parameters())
    knobs = dict(CPU_OPTIMIZER)
    c = weigh(model, knobs, Memories(), base=plan_base("fp32"), nvme_path=str(tmp_path))
    assert c.prediction is not None
    assert c.prediction.needs["cpu"]["homes"] == psi * (12 + 4)
    assert c.prediction.needs["gpu"]["homes"] == psi * 4


def test_recommended_config_is_deepspeed_stage3_with_tier_budgets(tmp_path: Path) -> None:
    model = _meta()
    mem = Memories(gpu=64 * 2**20, cpu=2 * 2**30, nvme=10 * GB)
    pinned = Pinned({"offload_optimizer": "nvme", "offload_param": "nvme"})
    best = search(model, mem, pinned, nvme_path=str(tmp_path / "nv")).best
    assert best is not None
    cfg = best.config
    json.dumps(cfg)  # JSON-able
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and cfg["bf16"] == {"enabled": True}
    assert z["offload_optimizer"]["device"] == "nvme" and z["offload_param"]["device"] == "nvme"
    assert z["offload_param"]["nvme_path"] == z["offload_optimizer"]["nvme_path"] == str(tmp_path / "nv")
    resolved = load_config(cfg, model=model)  # what the engine reads
    assert resolved.zero.sub_group_size_numel == best.knobs["sub_group_size"]
    tiers = cfg["tiered"]["tiers"]
    assert tiers["gpu"]["budget"] <= mem.gpu and tiers["cpu"]["budget"] <= mem.cpu
    assert tiers["nvme"]["budget"] <= mem.nvme
    for name, spec in tiers.items():  # every tier's need within the budget written
        assert best.prediction is not None
        assert best.prediction.needs.get(name, {"total": 0})["total"] <= spec["budget"]


def test_the_search_writes_no_default_of_its_own(tmp_path: Path) -> None:
    """A key the search does not choose is left out of its config: the declaration's default
    applies ([Note: one declaration per key]); without an nvme_path no NVMe placement is weighed
    (the planner invents no folder)."""
    model = _meta()
    result = search(model, Memories(gpu=8 * GB, cpu=8 * GB))
    assert result.weighed and all("nvme" not in c.placement for c in result.weighed)
    assert result.best is not None
    z = result.best.config["zero_optimization"]
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "overlap_comm"):
        assert key not in z
    assert "pin_memory" not in json.dumps(result.best.config)
    with_nvme = search(model, Memories(gpu=8 * GB, cpu=8 * GB), nvme_path=str(tmp_path))
    assert any(c.placement == ("nvme", "nvme", "nvme") for c in with_nvme.weighed)


def test_cheapest_fit_prefers_no_offload_then_an_offloaded_optimizer(tmp_path: Path) -> None:
    model = _meta(hidden_size=256, intermediate_size=704, num_hidden_layers=4)
    psi = sum(p.numel() for p in model.parameters())
    kw: dict[str, Any] = {"nvme_path": str(tmp_path), "device_kind": "cpu"}
    roomy = search(model, Memories(gpu=8 * GB, cpu=8 * GB), **kw).best
    assert roomy is not None and roomy.placement == ("none", "none", "gpu")
    assert roomy.config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    # 16 B per parameter do not fit a GPU of 8 B per parameter: the optimizer state leaves it
    tight = search(model, Memories(gpu=8 * psi, cpu=8 * GB), **kw).best
    assert tight is not None and tight.placement[0] != "none"
    # a memory not given is not checked
    unknown = search(model, Memories(gpu=8 * psi), **kw).best
    assert unknown is not None and unknown.placement[0] != "none"
    assert "cpu" not in unknown.config["tiered"]["tiers"]


def test_world_size_shards_every_offloaded_term(tmp_path: Path) -> None:
    model = _meta()
    knobs = {**CPU_OPTIMIZER, "offload_param": "cpu"}
    one = weigh(model, knobs, Memories(), nvme_path=str(tmp_path), world_size=1).prediction
    eight = weigh(model, knobs, Memories(), nvme_path=str(tmp_path), world_size=8).prediction
    assert one is not None and eight is not None
    assert eight.needs["cpu"]["homes"] == pytest.approx(one.needs["cpu"]["homes"] / 8, rel=0.01)


def test_nothing_fits_says_by_how_much(tmp_path: Path) -> None:
    result = search(_meta(), Memories(gpu=2**20, cpu=2**20, nvme=2**20), nvme_path=str(tmp_path))
    assert result.best is None
    near = result.closest
    assert near is not None and near.shortfalls
    text = shortfall_text(near)
    assert "short by" in text and ("GPU" in text or "host memory" in text)


def test_activation_memory_is_taken_off_the_gpu_budget(tmp_path: Path) -> None:
    knobs = dict(CPU_OPTIMIZER)
    kw: dict[str, Any] = {"nvme_path": str(tmp_path), "max_live": 10**9}
    without = weigh(_meta(), knobs, Memories(gpu=GB, activations=0), **kw)
    with_act = weigh(_meta(), knobs, Memories(gpu=GB, activations=12345), **kw)
    budgets = [c.config["tiered"]["tiers"]["gpu"]["budget"] for c in (without, with_act)]
    assert budgets[0] - budgets[1] == 12345


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


def test_bad_options_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tiered.cli.main import main

    with pytest.raises(ConfigError, match="--precision"):
        plan_base("int8")
    for argv, needle in (
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--largest-layer", "2B"], "--largest-layer (2,000,000,000) cannot exceed --params"),
        (["--prefetch-layers", "-1"], "--prefetch-layers must be >= 0"),
    ):
        assert main(["plan", "--params", "1B", *argv]) == 2
        assert needle in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(small_llama_config().to_dict()))
    assert main(["plan", "--model", str(tmp_path), "--largest-layer", "1M"]) == 2
    assert "--largest-layer sizes the --params stand-in" in capsys.readouterr().err


def test_prefetch_layers_is_written_as_the_prefetch_bucket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiered.cli.main import main

    (tmp_path / "config.json").write_text(json.dumps(small_llama_config().to_dict()))
    argv = [
        "plan",
        "--model",
        str(tmp_path),
        "--gpu-mem",
        "1GiB",
        "--nvme-path",
        str(tmp_path / "nv"),
        "--json",
    ]
    assert main([*argv, "--prefetch-layers", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    largest = doc["model"]["largest_layer_params"]
    assert doc["config"]["zero_optimization"]["stage3_prefetch_bucket_size"] == 3 * largest
    assert main(argv) == 0  # not given: the config's own default, not written
    assert (
        "stage3_prefetch_bucket_size"
        not in json.loads(capsys.readouterr().out)["config"]["zero_optimization"]
    )


def test_a_plan_leaves_no_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reading a candidate with an NVMe placement once created its nvme_path, and `tiered plan`
    (and the demo's 40B verdict) left ./tiered_offload behind; parsing now creates nothing
    ([Note: config parsing is pure])."""
    from tiered.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--params", "1e8", "--gpu-mem", "1GB", "--cpu-mem", "2GB", "--nvme-mem", "1TB"]) == 0
    assert '"nvme_path": "./tiered_offload"' in capsys.readouterr().out  # weighed, and printed
    assert list(tmp_path.iterdir()) == []
