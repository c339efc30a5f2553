"""`tiered bench --training`: the replayed pattern is the engine's (bytes per link equal a real
step's), `--check` produces both figures, `--tune` writes a fragment tiered's config layer loads.
No timed assertion: speeds are measured, never asserted."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import tiered.bench.tune as tune_mod
from tiered.bench.pattern import derive_pattern
from tiered.bench.training import LinkFigure, bench_training
from tiered.bench.training_check import measure_training
from tiered.cli.main import main
from tiered.config import load_config
from tiered.errors import ConfigError
from tiered.finetune.model import build_model, resolve_model
from tiered.planning.traffic import backward_rereads

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-llama"
DS = json.loads((ROOT / "examples" / "ds_config.json").read_text())


def _config(tmp_path: Path, **zero: Any) -> dict[str, Any]:
    """The example's config, its storage homes' moves replayed: nothing kept in memory across
    steps ([Note: residency]; with it, this tiny model's whole state would stay in memory and
    there would be no storage pattern to replay; `test_replay_leaves_out_what_the_budget_keeps`
    replays the budget's kept set)."""
    cfg = copy.deepcopy(DS)
    cfg["tiered"] = {"residency": "off"}
    z = cfg["zero_optimization"]
    for k in ("offload_param", "offload_optimizer"):
        z[k]["nvme_path"] = str(tmp_path / "offload")
    for k, v in zero.items():
        if isinstance(v, dict):
            z[k].update(v)
        else:
            z[k] = v
    return cfg


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    (tmp_path / "offload").mkdir(exist_ok=True)
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg))
    return p


OVERLAPPED = {"gradient_clipping": 0.0}  # clipping needs the global norm: the step would wait


@pytest.mark.parametrize(
    "label, zero, tiered_keys, top",
    [
        ("params kept in cpu by max_in_cpu", {}, {}, {}),
        ("params on nvme too", {"offload_param": {"max_in_cpu": 0}}, {}, {}),
        ("gradients on nvme", {}, {"grad_tier": "nvme"}, {}),
        ("optimizer only", {"offload_param": {"device": "none"}}, {}, {}),
        (
            "gradients on nvme, the step overlapped: consumed from memory",
            {"offload_param": {"max_in_cpu": 0}},
            {"grad_tier": "nvme", "overlap_step_with_backward": True},
            OVERLAPPED,
        ),
        (
            "2 micro-batches a step, gradients on nvme",
            {"offload_param": {"max_in_cpu": 0}},
            {"grad_tier": "nvme"},
            {"gradient_accumulation_steps": 2},
        ),
        ("int8 moments, tiled", {"sub_group_size": 20000}, {"optimizer_state_format": "int8"}, {}),
    ],
)
def test_replayed_bytes_per_link_equal_a_real_runs(
    tmp_path: Path, label: str, zero: dict[str, Any], tiered_keys: dict[str, Any], top: dict[str, Any]
) -> None:
    """The pattern comes from the engine's grouping and placement: each storage link moves the
    bytes a real step moves (mean of 3 steps, within 5%: a step's last write-backs land in the
    next step's window)."""
    raw = _config(tmp_path, **zero)
    if tiered_keys:
        raw["tiered"].update(tiered_keys)
    raw.update(top)
    (tmp_path / "offload").mkdir()
    source = resolve_model(TINY)
    model = build_model(source, meta=True)
    cfg = load_config(raw, model=model)
    predicted = bench_training(model, cfg, steps=1, warmup=1)
    real = measure_training(lambda: build_model(source), cfg, steps=3, warmup=1, seq_len=16)
    measured = real.links
    assert real.step_s > 0 and 0 <= real.compute_s <= real.step_s
    assert predicted.links, label
    assert {f.link for f in predicted.links} == {f.link for f in measured}, label
    for m in measured:
        p = predicted.link(m.link)
        assert p is not None and p.gbps is not None and m.gbps is not None
        assert m.bytes_per_step == pytest.approx(p.bytes_per_step, rel=0.05), (label, m.link)
    assert list((tmp_path / "offload").iterdir()) == [], "the replay left swap files"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "homes",
    [
        {"param": "nvme", "max_in_cpu": 0, "grad_tier": "nvme"},
        {"param": "nvme", "max_in_cpu": None, "grad_tier": "cpu"},
        {"param": "none", "max_in_cpu": None, "grad_tier": "nvme"},
    ],
    ids=["all-on-nvme", "params-kept-in-cpu", "optimizer-and-grads-on-nvme"],
)
@pytest.mark.parametrize("state_format", ["fp32", "int8"])
def test_replayed_pattern_moves_the_formulas_bytes(
    tmp_path: Path, precision: str, accumulation: int, overlap: bool, homes: dict[str, Any], state_format: str
) -> None:
    """One model of bytes: the replayed pattern's storage bytes per step are [Note: bytes per
    step]'s, what `tiered plan` and `stats()` hold the engine to, with accumulation, the step
    overlapped (gradients consumed from memory), compressed moments in their tiles, kept
    parameters and fp32 masters taken from the gathered copy."""
    from tiered.planning.needs import predict
    from tiered.planning.traffic import config_bytes_per_step, measured_per_step

    raw = _config(tmp_path, offload_param={"device": homes["param"]})
    if homes["max_in_cpu"] is not None:
        raw["zero_optimization"]["offload_param"]["max_in_cpu"] = homes["max_in_cpu"]
    raw["zero_optimization"]["sub_group_size"] = 30000
    raw["gradient_accumulation_steps"] = accumulation
    raw["gradient_clipping"] = 0.0
    if precision == "bf16":
        raw["bf16"] = {"enabled": True}
    raw["tiered"] |= {
        "grad_tier": homes["grad_tier"],
        "overlap_step_with_backward": overlap,
        "optimizer_state_format": state_format,
    }
    model = build_model(resolve_model(TINY), meta=True)
    cfg = load_config(raw, model=model)
    pattern = derive_pattern(model, cfg, gpu_budget_bytes=None, gpu_is_host=True)
    pred = predict(model, cfg, gpu_is_host=True, device_kind="cpu")
    formula = config_bytes_per_step(pred, cfg)
    replayed = measured_per_step(
        {k: {"bytes": v} for k, v in pattern.predicted_bytes().items()}, pred.memory, 1
    )
    assert formula["disk->host"] > 0 and formula["host->disk"] > 0
    assert (replayed["disk->host"], replayed["host->disk"]) == (formula["disk->host"], formula["host->disk"])
    assert pattern.micro_batches == accumulation


def test_pattern_follows_the_engines_grouping(tmp_path: Path) -> None:
    """Partition sizes are the engine's shards: with room for two decoder layers a layer is one
    group (fewer, larger partitions), with the example's tight budgets one per module; the
    bytes per step do not change with it beyond padding."""
    source = resolve_model(TINY)
    model = build_model(source, meta=True)
    roomy = _config(tmp_path, sub_group_size=100_000_000, stage3_max_live_parameters=1_000_000_000)
    big = derive_pattern(model, load_config(roomy, model=model), gpu_budget_bytes=None, gpu_is_host=True)
    small = derive_pattern(
        model, load_config(_config(tmp_path), model=model), gpu_budget_bytes=None, gpu_is_host=True
    )
    assert small.groups > big.groups
    assert small.size_range()[1] < big.size_range()[1]
    b, s = big.predicted_bytes()["nvme->cpu"], small.predicted_bytes()["nvme->cpu"]
    assert s == pytest.approx(b, rel=0.05)
    # fp32 with state and params on nvme: the parameter is the master, only exp_avg(_sq) move
    assert {p.name.split(".")[1] for p in big.partitions} == {"exp_avg", "exp_avg_sq"}


def test_backward_rereads_follow_the_live_budget() -> None:
    numel = [100] * 6
    flat = [False] * 6
    assert backward_rereads(numel, flat, max_live=10_000, max_reuse=10_000) == set()
    # room for two: everything but the last groups of the forward is gone by the backward
    assert backward_rereads(numel, flat, max_live=200, max_reuse=10_000) == {0, 1, 2, 3}
    # reuse distance 0: every group is evicted at release
    assert backward_rereads(numel, flat, max_live=10_000, max_reuse=0) == set(range(6)) - {5}
    assert backward_rereads(numel, [True] * 6, max_live=0, max_reuse=0) == set()


def test_cli_training_check_prints_both_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write(tmp_path, _config(tmp_path))
    out_json = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "--training",
            "--model",
            str(TINY),
            "--config",
            str(cfg),
            "--steps",
            "1",
            "--check",
            "--seq-len",
            "16",
            "--quiet",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert rc in (0, 1)  # 1 = off by more than 20% on this busy machine: a figure, not a test failure
    assert "predicted GB/s" in out and "measured GB/s" in out and "nvme->cpu" in out
    doc = json.loads(out_json.read_text())
    for link in ("nvme->cpu", "cpu->nvme"):
        row = doc["check"]["links"][link]
        assert row["predicted"]["gbps"] > 0 and row["measured"]["gbps"] > 0
        assert row["predicted"]["seconds_per_step"] > 0 and row["measured"]["seconds_per_step"] > 0
        assert doc["training"]["links"][link]["bytes_per_step"] == row["predicted"]["bytes_per_step"]
    assert (rc == 0) == doc["check"]["within_tolerance"]
    # the replay rested for the real steps' compute time (their running median) between its moves
    assert doc["training"]["compute_s"] > 0 and doc["check"]["compute_s"] > 0
    assert list((tmp_path / "offload").iterdir()) == []


def test_dir_moves_the_replay_to_another_drive_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _write(tmp_path, _config(tmp_path))
    drive = tmp_path / "drive"
    drive.mkdir()
    argv = ["bench", "--training", "--model", str(TINY), "--config", str(cfg), "--steps", "1", "--quiet"]
    assert main([*argv, "--dir", str(drive)]) == 0
    assert "nvme->cpu" in capsys.readouterr().out
    assert list(drive.iterdir()) == [] and list((tmp_path / "offload").iterdir()) == []


def test_tune_fragment_is_valid_config_and_holds_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fragment merges into the user's config, loads through tiered's config layer, and its
    values are the setting with the least I/O time (made deterministic here by a fake clock)."""
    real = tune_mod.bench_training
    seconds = {(256 << 10, 4, 1): 0.5, (1 << 20, 4, 1): 0.2, (256 << 10, 16, 1): 0.9, (1 << 20, 16, 1): 0.3}

    def fake(model: Any, cfg: Any, **kw: Any) -> Any:
        res = real(model, cfg, **kw)
        a = cfg.aio
        s = seconds[(a.block_size_bytes, a.queue_depth, a.thread_count)]
        links = tuple(
            LinkFigure(f.link, f.bytes_per_step, s, f.ops_per_step, f.max_inflight) for f in res.links
        )
        return dataclasses.replace(res, links=links)

    monkeypatch.setattr(tune_mod, "bench_training", fake)
    monkeypatch.setattr(
        tune_mod,
        "DEFAULT_GRID",
        {"block_size": (256 << 10, 1 << 20), "queue_depth": (4, 16), "thread_count": (1,)},
    )
    raw = _config(tmp_path)
    cfg_path = _write(tmp_path, raw)
    frag_path = tmp_path / "best.json"
    rc = main(
        ["bench", "--training", "--model", str(TINY), "--config", str(cfg_path), "--steps", "1", "--quiet"]
        + ["--tune", str(frag_path)]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "(best)" in out
    frag = json.loads(frag_path.read_text())
    assert frag["aio"] == {"block_size": 1 << 20, "queue_depth": 4, "thread_count": 1}
    merged = copy.deepcopy(raw)
    merged["aio"].update(frag["aio"])
    merged["tiered"] = frag["tiered"]
    model = build_model(resolve_model(TINY), meta=True)
    loaded = load_config(merged, model=model)
    assert loaded.aio.block_size_bytes == 1 << 20 and loaded.aio.queue_depth == 4
    nvme = loaded.tiered.tiers["nvme"].backend
    assert (nvme["block_size"], nvme["queue_depth"], nvme["thread_count"]) == (1 << 20, 4, 1)
    assert nvme["swap"] is True  # the derived swap keys the fragment leaves out are kept
    assert list((tmp_path / "offload").iterdir()) == []


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--training", "--config", "CFG"], "--training needs --model"),
        (["--training", "--model", str(TINY)], "--training needs --config"),
        (
            ["--training", "--model", str(TINY), "--config", "no/such.json"],
            "--config no/such.json: no such file",
        ),
        (["--training", "--model", str(TINY), "--config", "CFG", "--sweep"], "--training replays one model"),
        (["--training", "--model", str(TINY), "--config", "CFG", "--steps", "0"], "--steps must be >= 1"),
        (
            ["--training", "--model", str(TINY), "--config", "CFG_NO_NVME", "--tune", "x.json"],
            "--tune sweeps the nvme backend's knobs",
        ),
    ],
)
def test_training_bad_input_exits_2(
    tmp_path: Path, extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _write(tmp_path, _config(tmp_path))
    no_nvme = _config(tmp_path)
    for k in ("offload_param", "offload_optimizer"):
        no_nvme["zero_optimization"][k] = {"device": "cpu"}
    (tmp_path / "cpu.json").write_text(json.dumps(no_nvme))
    argv = [
        {"CFG": str(cfg), "CFG_NO_NVME": str(tmp_path / "cpu.json")}.get(a, a)
        for a in ["bench", "--quiet", *extra]
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiered bench: error:") and needle in err, err


def test_training_without_space_says_the_bytes_needed_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tiered.bench.preflight as pf

    monkeypatch.setattr(pf, "free_bytes", lambda path: 4096)
    cfg = _write(tmp_path, _config(tmp_path))
    rc = main(["bench", "--quiet", "--training", "--model", str(TINY), "--config", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and "free, the benchmark needs about" in err and "bytes:" in err
    assert list((tmp_path / "offload").iterdir()) == []


def test_the_fragment_shown_in_the_docs_loads(tmp_path: Path) -> None:
    import re

    doc = (ROOT / "docs" / "backends.md").read_text()
    blocks = re.findall(r"^```json\n(.*?)^```$", doc, re.M | re.S)
    frag = next(json.loads(b) for b in blocks if '"aio"' in b)
    merged = _config(tmp_path)
    merged["aio"].update(frag["aio"])
    merged["tiered"] = frag["tiered"]
    loaded = load_config(merged, model=build_model(resolve_model(TINY), meta=True))
    assert loaded.tiered.tiers["nvme"].backend["queue_depth"] == frag["aio"]["queue_depth"]


def test_compute_time_is_spent_between_the_moves(tmp_path: Path) -> None:
    """--compute-s: the replay rests the links for that long per step (split over the passes)."""
    import time

    (tmp_path / "offload").mkdir()
    source = resolve_model(TINY)
    model = build_model(source, meta=True)
    cfg = load_config(_config(tmp_path), model=model)
    t0 = time.perf_counter()
    res = bench_training(model, cfg, steps=2, warmup=0, compute_s=0.5)
    assert time.perf_counter() - t0 >= 2 * 0.5
    assert res.compute_s == 0.5 and "0.500 s of forward + backward compute" in res.to_markdown()
    with pytest.raises(ConfigError, match="--compute-s must be >= 0"):
        bench_training(model, cfg, steps=1, compute_s=-1)


def test_a_measured_real_step_leaves_no_move_to_land_after_its_window(tmp_path: Path) -> None:
    """`--check` interleaves real and replayed steps: a move the real step started that landed
    after its window (the next forward's parameters, which the step prefetches) was counted by
    no real step and ran during the replayed one, and the real nvme->gpu figure came out 40% low."""
    import time

    import tiered
    from tiered.bench.training import _delta
    from tiered.bench.training_check import _real_step

    raw = _config(tmp_path, offload_param={"max_in_cpu": 0})
    (tmp_path / "offload").mkdir()
    source = resolve_model(TINY)
    model = build_model(source)
    cfg = load_config(raw, model=model)
    with tiered.initialize(model, cfg) as engine:
        for s in range(3):
            step = _real_step(engine, model, cfg, 16, seed=s)
            after = engine.stats()["tiers"]["links"]
            time.sleep(0.5)  # anything still in flight lands now
            late = {k: v for k, v in _delta(after, engine.stats()["tiers"]["links"]).items() if v["bytes"]}
            assert late == {}, f"step {s}: moves landed after its window: {late}"
            if s:
                assert step.delta["nvme->gpu"]["bytes"] > 0


def test_the_pattern_prefetches_the_next_forward_after_the_step_as_the_engine_does(tmp_path: Path) -> None:
    """`ZeroParameters.params_updated` prefetches the next forward's first groups up to
    stage3_prefetch_bucket_size, within the live budget, and not when the step overlaps backward."""
    source = resolve_model(TINY)
    model = build_model(source, meta=True)

    def pattern(**zero: Any) -> Any:
        room = {"stage3_prefetch_bucket_size": 1e9, "stage3_max_live_parameters": 1e9}
        raw = _config(tmp_path, offload_param={"max_in_cpu": 0}, **{**room, **zero})
        return derive_pattern(model, load_config(raw, model=model), gpu_budget_bytes=None, gpu_is_host=True)

    roomy = pattern()
    forward = [p.name for p in roomy.partitions if p.phase == "forward"]
    assert forward and roomy.after_step_prefetch == frozenset(forward)  # the bucket covers it all
    first = [p for p in roomy.partitions if p.phase == "forward"][0]
    one = pattern(stage3_prefetch_bucket_size=1)
    assert one.after_step_prefetch == {first.name}  # the group that crosses the bucket is included
    # a live budget the largest module's gather just fits (the engine refuses a smaller one):
    # the prefix of the forward that fits it, not the whole bucket
    numel = {p.name: p.numel for p in roomy.partitions if p.phase == "forward"}
    budget = max(numel.values())
    tight = pattern(stage3_max_live_parameters=budget)
    k = len(tight.after_step_prefetch)
    assert 0 < k < len(forward) and tight.after_step_prefetch == frozenset(forward[:k])
    assert (
        sum(numel[n] for n in tight.after_step_prefetch) <= budget < sum(numel[n] for n in forward[: k + 1])
    )
    raw = _config(
        tmp_path,
        offload_param={"max_in_cpu": 0},
        stage3_prefetch_bucket_size=1e9,
        stage3_max_live_parameters=1e9,
    )
    raw["tiered"]["overlap_step_with_backward"] = True
    applies = derive_pattern(model, load_config(raw, model=model), gpu_budget_bytes=None, gpu_is_host=True)
    assert (
        applies.after_step_prefetch == roomy.after_step_prefetch
    )  # gradient clipping: the step is after backward
    raw["gradient_clipping"] = 0.0
    overlapped = derive_pattern(model, load_config(raw, model=model), gpu_budget_bytes=None, gpu_is_host=True)
    assert overlapped.after_step_prefetch == frozenset()


def test_with_parameters_on_nvme_every_storage_link_moves_a_real_step_s_bytes(tmp_path: Path) -> None:
    """fp32, the parameter is the master: the step's state prefetch reads the first groups'
    masters from their copies still live in "gpu" (not from NVMe), and the step prefetches the
    next forward's parameters. The replay moves what a real step moves on every storage link,
    to the block, not within a tolerance that would hide a group."""
    raw = _config(
        tmp_path,
        offload_param={"max_in_cpu": 0},
        stage3_prefetch_bucket_size=1e9,
        stage3_max_live_parameters=1e9,
        stage3_max_reuse_distance=1e9,
    )
    (tmp_path / "offload").mkdir()
    source = resolve_model(TINY)
    model = build_model(source, meta=True)
    cfg = load_config(raw, model=model)
    predicted = bench_training(model, cfg, steps=1, warmup=1)
    assert predicted.pattern.live_into_step and predicted.pattern.after_step_prefetch
    real = measure_training(lambda: build_model(source), cfg, steps=2, warmup=1, seq_len=16)
    for m in real.links:
        p = predicted.link(m.link)
        assert p is not None and abs(m.bytes_per_step - p.bytes_per_step) <= 16 << 10, (m.link, m, p)


def test_replay_leaves_out_what_the_budget_keeps(tmp_path: Path) -> None:
    """[Note: residency]: with a cpu budget that has room for about half the optimizer state,
    the replay moves only what the engine does not keep, and a real run moves the same."""
    from tiered.planning.needs import predict

    raw = _config(tmp_path, offload_param={"max_in_cpu": 0})
    raw["gradient_clipping"] = 0.0
    (tmp_path / "offload").mkdir()
    source = resolve_model(TINY)
    model = build_model(source, meta=True)
    off = load_config(raw, model=model)
    everything = derive_pattern(model, off, gpu_budget_bytes=None, gpu_is_host=True).predicted_bytes()
    need = predict(model, off, gpu_is_host=True, device_kind="cpu", rooms={}).needs["cpu"]["total"]
    state = sum(
        p.nbytes
        for p in derive_pattern(model, off, gpu_budget_bytes=None, gpu_is_host=True).partitions
        if p.phase == "step" and p.writes and not p.name.endswith(".param")
    )
    raw["tiered"] = {"tiers": {"cpu": {"budget": need + state // 2}}}
    cfg = load_config(raw, model=model)
    kept = derive_pattern(model, cfg, gpu_budget_bytes=None, gpu_is_host=True)
    saved = everything["cpu->nvme"] - kept.predicted_bytes()["cpu->nvme"]
    assert 0.4 * state <= saved <= 0.5 * state, (saved, state)
    predicted = bench_training(model, cfg, steps=1, warmup=1)
    real = measure_training(lambda: build_model(source), cfg, steps=3, warmup=1, seq_len=16)
    for m in real.links:
        p = predicted.link(m.link)
        assert p is not None
        assert m.bytes_per_step == pytest.approx(p.bytes_per_step, rel=0.05), m.link
