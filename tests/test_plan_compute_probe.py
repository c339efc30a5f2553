"""[Note: model compute probe]: the plumbing of the compute term timed on the model's own layer
(what is built, what is timed, how the times become the step's compute and reach the plan's
s/step and its printed assumptions). No timing values are asserted: this machine is shared."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

from tiered.cli import plan_compute
from tiered.planning import compute_probe
from tiered.planning.compute_probe import (
    ModelCompute,
    decoder_layers,
    one_layer_bytes,
    one_layer_config,
    probe_model_compute,
)
from tiered.planning.timing import (
    compute_threads_beside_engine,
    intra_op_threads,
    probe_flops,
    read_bandwidth,
)

transformers = pytest.importorskip("transformers")

PLAN = ["plan", "--device", "cpu", "--precision", "fp32", "--gpu-mem", "1GB", "--cpu-mem", "8GB"]


def _model_dir(tmp_path: Path, **overrides: Any) -> Path:
    small_llama_config(**overrides).save_pretrained(tmp_path)
    return tmp_path


def _fixed(layers: int = 2) -> ModelCompute:
    return ModelCompute(
        layer_forward_s=0.5,
        layer_backward_s=1.0,
        rest_s=0.25,
        layers=layers,
        micro_batch=2,
        seq_len=8,
        dtype=torch.float32,
        device="cpu",
        passes=1,
    )


def test_step_seconds_scales_the_layer_by_depth_micro_batches_and_checkpointing() -> None:
    c = _fixed(layers=4)
    assert c.step_seconds() == pytest.approx(4 * 1.5 + 0.25)
    assert c.step_seconds(3) == pytest.approx(3 * (4 * 1.5 + 0.25))
    assert c.step_seconds(checkpointing=True) == pytest.approx(4 * 2.0 + 0.25)  # forward re-run


def test_one_layer_config_cuts_the_layers_and_leaves_the_original() -> None:
    cfg = small_llama_config(num_hidden_layers=3)
    cfg.layer_types = ["full_attention"] * 3
    one = one_layer_config(cfg)
    assert one.num_hidden_layers == 1 and one.layer_types == ["full_attention"]
    assert cfg.num_hidden_layers == 3 and len(cfg.layer_types) == 3
    assert one.hidden_size == cfg.hidden_size and one.vocab_size == cfg.vocab_size


def test_one_layer_bytes_counts_one_layer_and_everything_outside_the_layers() -> None:
    from transformers import LlamaForCausalLM

    cfg = small_llama_config(num_hidden_layers=3)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    assert one_layer_bytes(model, cfg, 4) == 2 * 4 * (total - 2 * layer)
    assert len(decoder_layers(model)) == 3


def test_probe_times_the_layer_and_the_rest_at_the_shape_given() -> None:
    cfg = small_llama_config(num_hidden_layers=3)
    c = probe_model_compute(cfg, micro_batch=2, seq_len=8, seconds=0.05, max_passes=2)
    assert (c.layers, c.micro_batch, c.seq_len, c.dtype, c.device) == (3, 2, 8, torch.float32, "cpu")
    assert 1 <= c.passes <= 2
    # every hook fired: the layer's forward and backward were each seen
    assert c.layer_forward_s > 0 and c.layer_backward_s > 0 and c.rest_s >= 0
    text = c.describe()
    assert "x 3 layers" in text and "2 x 8 tokens" in text and "float32 on cpu" in text
    assert c.threads == torch.get_num_threads() and f"{c.threads} threads" in text


def test_probe_runs_in_the_dtype_given() -> None:
    seen: list[torch.dtype] = []
    real = compute_probe.one_layer_model

    def spy(cfg: Any, dtype: torch.dtype, device: str) -> Any:
        model = real(cfg, dtype, device)
        seen.append(next(model.parameters()).dtype)
        return model

    mp = pytest.MonkeyPatch()
    mp.setattr(compute_probe, "one_layer_model", spy)
    try:
        c = probe_model_compute(
            small_llama_config(), micro_batch=1, seq_len=4, dtype=torch.bfloat16, seconds=0.01
        )
    finally:
        mp.undo()
    assert seen == [torch.bfloat16] and c.dtype == torch.bfloat16


def _plan_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from tiered.cli.main import main

    assert main(argv) == 0
    return capsys.readouterr().out


FAST_LINKS = ["--offload-optimizer", "none", "--offload-param", "none", "--grad-tier", "gpu"]


def test_plan_with_a_model_and_seq_len_counts_the_probed_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: list[dict[str, Any]] = []

    def fake(cfg: Any, **kw: Any) -> ModelCompute:
        asked.append(kw)
        return _fixed(layers=cfg.num_hidden_layers)

    monkeypatch.setattr(compute_probe, "probe_model_compute", fake)
    folder = _model_dir(tmp_path)
    argv = [*PLAN, "--model", str(folder), "--seq-len", "8", "--micro-batch", "2", *FAST_LINKS]
    with intra_op_threads(3):  # [Note: compute beside the engine's threads]: timed with one fewer
        out = _plan_text([*argv, "--accumulation", "3"], capsys)
    assert asked == [{"micro_batch": 2, "seq_len": 8, "dtype": torch.float32, "device": "cpu", "threads": 2}]
    assert "measured on the model's own work" in out and "one decoder layer's forward" in out
    assert "3 micro-batch(es) per step" in out
    seconds = float(out.split("predicted ")[1].split(" s/step")[0])
    compute = 3 * (2 * 1.5 + 0.25)  # 3 micro-batches of 2 layers x (0.5 + 1.0) + 0.25
    assert compute <= seconds < compute + 0.01  # + the Adam of a 0.2M model, on the same cores
    ckpt = _plan_text([*argv, "--checkpointing"], capsys)
    seconds = float(ckpt.split("predicted ")[1].split(" s/step")[0])
    assert 2 * 2.0 + 0.25 <= seconds < 2 * 2.0 + 0.25 + 0.01
    assert "the layers' forward run twice (checkpointing)" in ckpt


def test_plan_keeps_the_matmul_probe_and_flops_where_the_model_is_not_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*_: Any, **__: Any) -> ModelCompute:
        raise AssertionError("the model probe ran")

    monkeypatch.setattr(compute_probe, "probe_model_compute", refuse)
    monkeypatch.setattr("tiered.planning.timing.probe_flops", lambda *a, **k: 1e9)
    folder = _model_dir(tmp_path)
    given = _plan_text(
        [*PLAN, "--model", str(folder), "--seq-len", "8", "--flops", "2e9", *FAST_LINKS], capsys
    )
    assert "compute 0.002 TFLOP/s (--flops)" in given
    shape = _plan_text([*PLAN, "--params", "1e6", "--seq-len", "8", *FAST_LINKS], capsys)
    assert "matmul timed on this machine's cpu" in shape
    no_seq = _plan_text([*PLAN, "--model", str(folder), "--tokens-per-step", "64", *FAST_LINKS], capsys)
    assert "own layer not timed (give --seq-len)" in no_seq and "matmul timed" in no_seq
    monkeypatch.setattr(plan_compute, "PROBE_MAX_BYTES", 1000)
    big = _plan_text([*PLAN, "--model", str(folder), "--seq-len", "8", *FAST_LINKS], capsys)
    assert "own layer not timed (one layer + embedding/head need" in big and "matmul timed" in big


def test_plan_for_a_gpu_without_one_does_not_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the probe would run on it")

    def refuse(*_: Any, **__: Any) -> ModelCompute:
        raise AssertionError("the model probe ran")

    monkeypatch.setattr(compute_probe, "probe_model_compute", refuse)
    folder = _model_dir(tmp_path)
    out = _plan_text(
        ["plan", "--model", str(folder), "--seq-len", "8", "--gpu-mem", "8GB", "--cpu-mem", "8GB"], capsys
    )
    assert "compute: not modelled: planning for a GPU on a machine without one" in out


def test_compute_beside_the_engine_takes_one_core_from_the_run_at_least_one_left() -> None:
    # [Note: compute beside the engine's threads]
    assert [compute_threads_beside_engine(n) for n in (1, 2, 16)] == [1, 1, 15]
    with intra_op_threads(3):
        assert compute_threads_beside_engine() == 2


def test_the_probes_run_with_the_threads_asked_and_give_torchs_back() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    real = compute_probe.one_layer_model

    def spy(cfg: Any, dtype: torch.dtype, device: str) -> Any:
        seen.append(torch.get_num_threads())
        return real(cfg, dtype, device)

    mp = pytest.MonkeyPatch()
    mp.setattr(compute_probe, "one_layer_model", spy)
    try:
        with intra_op_threads(2):
            c = probe_model_compute(small_llama_config(), micro_batch=1, seq_len=4, seconds=0.01, threads=1)
            assert torch.get_num_threads() == 2
    finally:
        mp.undo()
    assert seen == [1] and c.threads == 1 and "1 threads" in c.describe()
    assert torch.get_num_threads() == before
    with intra_op_threads(2):
        assert probe_flops("cpu", seconds=0.01, threads=1) > 0 and torch.get_num_threads() == 2


def test_the_matmul_probe_of_the_plan_and_the_bench_times_one_thread_fewer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: list[int | None] = []

    def fake(device: str, dtype: torch.dtype, seconds: float = 0.3, threads: int | None = None) -> float:
        asked.append(threads)
        return 1e9

    monkeypatch.setattr("tiered.planning.timing.probe_flops", fake)
    with intra_op_threads(3):
        out = _plan_text([*PLAN, "--params", "1e6", "--seq-len", "8", *FAST_LINKS], capsys)
        from tiered.cli.bench import _compute_rate

        said = io.StringIO()
        entry = _compute_rate(said)
    assert asked == [2, 2] and "with 2 thread(s), one fewer than the run's" in out
    assert entry["threads"] == 2 and "2 of 3 threads" in said.getvalue()


def test_the_bandwidth_file_gives_the_engines_nvme_backend_over_the_faster_ceiling(tmp_path: Path) -> None:
    def method(name: str, kind: str, read: float, write: float) -> dict[str, Any]:
        return {"name": name, "kind": kind, "status": "ok", "read_gbps": read, "write_gbps": write}

    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "methods": [
                    method("O_DIRECT pwritev/preadv 8 threads x 8 MiB", "ceiling", 3.0, 2.5),
                    method("tiered backend: nvme", "backend", 1.5, 1.2),
                ]
            }
        )
    )
    bw, said = read_bandwidth(path)
    assert (bw["disk_read"], bw["disk_write"]) == (1.5e9, 1.2e9)
    assert any("tiered backend: nvme" in s for s in said)
