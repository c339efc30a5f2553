"""`tiered finetune --trace / --plot`: module compute, moves per link, the Adam per group and the
steps in one Perfetto-loadable Chrome trace ([Note: trace lanes], [Note: compute spans]), the
per-lane table of the last step and the PNG ([Note: step timeline plot])."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from finetune_support import ds_config, write_jsonl, write_model
from torch import nn

from tiered.cli.finetune import finetune_job
from tiered.cli.finetune.options import FinetuneOptions
from tiered.cli.main import main
from tiered.finetune.trace import ComputeTracer, traced_blocks
from tiered.tiers.trace import TraceRecorder


def _setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    model = write_model(tmp_path / "m")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the fast place {i} is small."} for i in range(30)])
    cfg = tmp_path / "ds.json"
    raw = ds_config(tmp_path / "nvme")
    raw["tiered"] = {"residency": "off"}  # every step's state through the nvme tier: links to trace
    cfg.write_text(json.dumps(raw))
    return model, data, cfg


def _assert_perfetto_shape(doc: dict[str, Any]) -> None:
    """Chrome's JSON object format as Perfetto reads it: X events with µs ts/dur, a name for
    every thread, and the events of one thread never overlapping without nesting."""
    events = doc["traceEvents"]
    names = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    by_tid: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            assert e["tid"] in names and e["dur"] >= 0 and isinstance(e["pid"], int)
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_tid.values():
        spans.sort()
        for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False):
            assert b_start >= a_end - 1e-6


def test_overlapping_moves_go_to_separate_lanes() -> None:
    rec = TraceRecorder(True)
    t = rec._t0
    rec.add("a", "cpu->gpu", t + 0.0, t + 0.3)
    rec.add("b", "cpu->gpu", t + 0.1, t + 0.2)  # overlaps a
    rec.add("c", "cpu->gpu", t + 0.4, t + 0.5)  # after both: back on the first lane
    doc = rec.to_json()
    _assert_perfetto_shape(doc)
    tid = {e["name"]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tid["a"] == tid["c"] != tid["b"]
    assert lanes[tid["a"]] == "cpu->gpu" and lanes[tid["b"]] == "cpu->gpu #2"


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return x


class _Spans:
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []

    def record_span(self, name: str, track: str, start_s: float, end_s: float, **args: Any) -> None:
        self.spans.append((name, track, start_s, end_s))


def test_compute_tracer_times_each_block_and_changes_no_gradient() -> None:
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(4, 8, requires_grad=True)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    assert [n for n, _ in traced_blocks(model)] == ["layers.0", "layers.1", "layers.2"]
    rec = _Spans()
    tracer = ComputeTracer(model, rec)
    model(x).square().sum().backward()
    tracer.remove()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))  # type: ignore[arg-type]
    names = [n for n, *_ in rec.spans]
    assert names == [
        "forward layers.0",
        "forward layers.1",
        "forward layers.2",
        "backward layers.2",
        "backward layers.1",
        "backward layers.0",
    ]
    assert all(track == "compute" and t1 >= t0 for _, track, t0, t1 in rec.spans)
    model(x).sum().backward()
    assert len(rec.spans) == 6  # removed: nothing more recorded


def test_trace_records_compute_links_adam_and_steps(tmp_path: Path) -> None:
    model, data, cfg = _setup(tmp_path)
    trace = tmp_path / "trace.json"
    out = io.StringIO()
    job = finetune_job(
        FinetuneOptions(model_path=model, config=cfg, data_path=data, seq_len=16, steps=2, trace_path=trace),
        out,
    )
    assert job.result.steps_done == 2
    doc = json.loads(trace.read_text())
    _assert_perfetto_shape(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    cats = {e["cat"] for e in xs}
    assert {"compute", "adam", "step", "cpu->nvme", "nvme->cpu"} <= cats
    names = {e["name"] for e in xs}
    for layer in ("model.layers.0", "model.layers.1"):
        assert f"forward {layer}" in names and f"backward {layer}" in names
    assert "forward model.embed_tokens" in names and "forward lm_head" in names
    assert {"step 1", "step 2"} <= names
    adam = [e for e in xs if e["cat"] == "adam"]
    assert adam and all(e["name"].startswith("adam ") for e in adam)
    assert {e["args"]["step"] for e in adam} == {1, 2}
    nvme = [e for e in xs if "nvme" in e["cat"]]
    assert nvme and all(e["args"]["bytes"] > 0 for e in nvme)  # disk I/O, with its bytes
    text = out.getvalue()
    assert "step 2: " in text and "compute" in text and "adam" in text  # the per-lane table
    assert f"trace written to {trace}" in text


def test_no_compute_hooks_unless_tracing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiered.finetune.trace as trace_mod

    class Installed(Exception):
        pass

    def refuse(self: Any, model: nn.Module, recorder: Any) -> None:
        raise Installed

    monkeypatch.setattr(trace_mod.ComputeTracer, "__init__", refuse)
    model, data, cfg = _setup(tmp_path)
    out = io.StringIO()
    finetune_job(FinetuneOptions(model_path=model, config=cfg, data_path=data, seq_len=16, steps=1), out)
    assert "trace written" not in out.getvalue()
    with pytest.raises(Installed):  # the same run with --trace does install them
        finetune_job(
            FinetuneOptions(
                model_path=model,
                config=cfg,
                data_path=data,
                seq_len=16,
                steps=1,
                trace_path=tmp_path / "t.json",
            ),
            out,
        )


def _cli(model: Path, data: Path, cfg: Path, *extra: str) -> int:
    argv = ["finetune", "--model", str(model), "--config", str(cfg), "--data", str(data), "--seq-len", "16"]
    return main([*argv, *extra])


def test_plot_draws_a_png_and_leaves_no_trace_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    model, data, cfg = _setup(tmp_path)
    png = tmp_path / "run.png"
    assert _cli(model, data, cfg, "--steps", "3", "--eval-fraction", "0.2", "--plot", str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot of step 3" in capsys.readouterr().out
    assert not list(tmp_path.glob(".trace-*"))  # the temporary trace is removed


def test_trace_into_a_missing_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, data, cfg = _setup(tmp_path)
    assert _cli(model, data, cfg, "--steps", "1", "--trace", str(tmp_path / "no" / "t.json")) == 2
    assert "--trace" in capsys.readouterr().err
