"""`tiered plan`'s flags and bench file, hostile (issue 37, items 1 and 2): each value checked
where it enters and named by the flag or field the user wrote; `--bandwidth` reads a regular
bench JSON of bounded size whose rates are finite numbers > 0 ([Note: files a user names])."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hostile_support import refused

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-llama"
MEMORIES = ["--gpu-mem", "8GB", "--cpu-mem", "8GB"]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--params", "1e30", "--gpu-mem", "80GB"], "--params: '1e30' is more than 1e+15 parameters"),
        (
            ["--params", "100M", "--seq-len", "64", "--flops", "0"],
            "argument --flops: must be a finite rate > 0",
        ),
        (
            ["--params", "100M", "--seq-len", "64", "--flops", "nan"],
            "argument --flops: must be a finite rate > 0",
        ),
        (
            ["--params", "100M", "--seq-len", "64", "--flops", "inf"],
            "argument --flops: must be a finite rate > 0",
        ),
        (["--params", "100M", "--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
        (
            ["--params", "100M", "--seq-len", "64", "--micro-batch", "0"],
            "argument --micro-batch: must be >= 1",
        ),
        (
            ["--model", str(TINY), "--seq-len", "4096"],
            "--seq-len 4096 exceeds the model's max_position_embeddings 256",
        ),
        (
            ["--model", str(TINY), "--largest-layer", "1e12"],  # --model counts its own largest module
            "--largest-layer sizes the --params stand-in's largest module; --model counts its own: drop",
        ),
        (
            ["--params", "1e9", "--largest-layer", "1e12"],
            "--largest-layer (1,000,000,000,000) cannot exceed --params (1,000,000,000)",
        ),
    ],
    ids=[
        "params-1e30",
        "flops-0",
        "flops-nan",
        "flops-inf",
        "seq-len-0",
        "micro-batch-0",
        "seq-len-4096",
        "largest-with-model",
        "largest-above-params",
    ],
)
def test_a_flag_out_of_range_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    assert said in refused(capsys, ["plan", *argv, *MEMORIES])


def _bench(tmp_path: Path, **doc: Any) -> Path:
    base: dict[str, Any] = {
        "methods": [{"name": "tiered backend: nvme", "status": "ok", "read_gbps": 2.0, "write_gbps": 1.5}]
    }
    base.update(doc)
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(base))
    return p


def _plan_with(capsys: pytest.CaptureFixture[str], path: Path | str) -> str:
    return refused(capsys, ["plan", "--params", "100M", *MEMORIES, "--bandwidth", str(path)])


def test_a_bench_file_that_is_no_regular_file_is_refused_without_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "--bandwidth /dev/zero: is a character device, not a regular file" in _plan_with(
        capsys, "/dev/zero"
    )
    os.mkfifo(tmp_path / "fifo.json")
    assert "is a FIFO, not a regular file" in _plan_with(capsys, tmp_path / "fifo.json")
    assert "is a directory, not a regular file" in _plan_with(capsys, tmp_path)
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(1 << 30)
    assert "1,073,741,824 bytes or more" in _plan_with(capsys, tmp_path / "big.json")
    deep = tmp_path / "deep.json"
    deep.write_text('{"methods": [], "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nests objects or lists deeper" in _plan_with(capsys, deep)


@pytest.mark.parametrize(
    "doc, field",
    [
        (
            {"methods": [{"name": "nvme", "status": "ok", "read_gbps": "fast", "write_gbps": 1.0}]},
            "methods[0].read_gbps is 'fast'",
        ),
        (
            {"methods": [{"name": "nvme", "status": "ok", "read_gbps": -2.0, "write_gbps": 1.0}]},
            "methods[0].read_gbps is -2.0",
        ),
        (
            {"methods": [{"name": "nvme", "status": "ok", "read_gbps": 2.0, "write_gbps": float("inf")}]},
            "methods[0].write_gbps is inf",
        ),
        ({"compute": {"flops_per_s": True}}, "compute.flops_per_s is True"),
        ({"compute": {"flops_per_s": 0}}, "compute.flops_per_s is 0"),
        ({"cpu_adam": {"elements_per_s": "x"}}, "cpu_adam.elements_per_s is 'x'"),
        ({"host_copy": {"gbps": -1.0}}, "host_copy.gbps is -1.0"),
        ({"host_copy": [1.0]}, "host_copy is list, not an object"),
        ({"gpu_link": {"available": True}}, 'gpu_link.h2d_gbps has no "pinned" rate'),
        (
            {"gpu_link": {"available": True, "h2d_gbps": {"pinned": -1}, "d2h_gbps": {"pinned": 1}}},
            "gpu_link.h2d_gbps.pinned is -1",
        ),
    ],
    ids=[
        "read-text",
        "read-negative",
        "write-inf",
        "flops-true",
        "flops-0",
        "adam-text",
        "copy-negative",
        "copy-not-object",
        "link-without-rates",
        "link-negative",
    ],
)
def test_a_bench_rate_that_is_no_finite_positive_number_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: dict[str, Any], field: str
) -> None:
    err = _plan_with(capsys, _bench(tmp_path, **doc))
    assert f"--bandwidth {tmp_path / 'bench.json'}: {field}" in err
    assert (
        "a measured rate is a finite number > 0" in err
        or "pass the file tiered bench --json FILE wrote" in err
    )


def test_a_nan_rate_written_by_python_json_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "bench.json"
    p.write_text('{"methods": [{"name": "nvme", "status": "ok", "read_gbps": NaN, "write_gbps": 1.0}]}')
    assert "methods[0].read_gbps is nan" in _plan_with(capsys, p)


def test_a_good_bench_file_still_sets_the_rates(tmp_path: Path) -> None:
    from tiered.planning.timing import read_bandwidth

    bw, said = read_bandwidth(_bench(tmp_path, compute={"flops_per_s": 4e12}))
    assert bw["disk_read"] == 2e9 and bw["disk_write"] == 1.5e9 and bw["flops"] == 4e12
    assert any("tiered backend: nvme" in s for s in said)
