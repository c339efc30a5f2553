"""The `tiered` command line: exit codes, one-line errors, help, `plan` text and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiered.cli.main import main

PLAN_40B = [
    "plan",
    "--params",
    "40B",
    "--gpu-mem",
    "80GB",
    "--cpu-mem",
    "512GB",
    "--nvme-mem",
    "4TB",
    "--world-size",
    "1",
]


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_plan_40b_prints_tables_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(PLAN_40B) == 0
    out = capsys.readouterr().out
    assert "recommended: optimizer nvme" in out
    assert "assumed: --params stand-in ([Note: shape model for --params]): a dense Llama" in out
    assert "Psi = 40,000,000,000" in out  # the ZeRO paper's table counts the parameters given
    assert "activations: NOT counted" in out
    assert "s/step" in out and "bytes per step" in out
    # The recommended config is printed as JSON at the end; its budgets never exceed the memories given.
    cfg = json.loads(out[out.index("{", out.index("recommended config")) :])
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    tiers = cfg["tiered"]["tiers"]
    assert (
        tiers["gpu"]["budget"] <= 80e9 and tiers["cpu"]["budget"] <= 512e9 and tiers["nvme"]["budget"] <= 4e12
    )
    lines = {
        line.split("  ")[0].strip(): line for line in out.splitlines() if line.startswith(("DP ", "ZeRO"))
    }
    assert "640.0" in lines["DP"] and "no (GPU +560.0)" in lines["DP"]
    assert "640.0" in lines["ZeRO-3"] and "no (GPU +560.0)" in lines["ZeRO-3"]  # model states alone
    # the offloaded rows are the search's, per placement: nothing fits with the optimizer state on the GPU
    rows = [
        line.split()
        for line in out.splitlines()
        if line.startswith("  ") and line.split()[:1] in (["none"], ["cpu"], ["nvme"])
    ]
    assert {tuple(r[:3]) for r in rows} >= {("none", "none", "gpu"), ("nvme", "cpu", "cpu")}
    for r in rows:
        assert r[-1] != "yes" or r[0] == "nvme", r  # what fits has the optimizer state on NVMe
    assert not any(r[0] == "none" and r[-1] == "yes" for r in rows)


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_plan_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN_40B, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {
        "model",
        "memories",
        "options",
        "bytes_per_param",
        "strategies",
        "recommended",
        "message",
        "config",
    }
    assert doc["bytes_per_param"] == {"param": 2, "grad": 2, "optimizer": 12}
    keys = [s["key"] for s in doc["strategies"]]
    assert keys == ["dp", "zero1", "zero2", "zero3"]  # the paper's table; offload is the search's
    assert doc["zero_table_params"] == 40 * 10**9
    placements = {
        (p["offload_optimizer"], p["offload_param"], p["grad_tier"]): p for p in doc["search"]["placements"]
    }
    assert not placements[("none", "none", "gpu")]["fits"] and placements[("nvme", "cpu", "cpu")]["fits"]
    best = doc["search"]["best"]
    assert best["config"] == doc["config"] and doc["recommended"]["offload_optimizer"] == "nvme"
    assert best["peaks_bytes"]["host"] <= 512e9 and best["peaks_bytes"]["device"] <= 80e9
    assert set(best["bytes_per_step"]) == {"disk->host", "host->disk", "host->device", "device->host"}
    assert doc["strategies"][0]["shortfall_bytes"] == {"gpu": 560_000_000_000}
    assert all({"tier", "what", "bytes"} == set(t) for s in doc["strategies"] for t in s["terms"])


def test_plan_device_sets_the_process_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    """--device: the host memory of the process that will train ([Note: one memory model]) comes
    off the cpu budget; cuda (the default) measured larger than cpu."""
    pinned = ["--offload-optimizer", "cpu", "--offload-param", "none", "--grad-tier", "cpu"]
    pinned += ["--sub-group-size", "1e7", "--buffer-count", "1", "--persistence-threshold", "0"]
    argv = ["plan", "--params", "1e8", "--gpu-mem", "8GiB", "--cpu-mem", "8GiB", *pinned, "--json"]
    docs = {}
    for device in ("cuda", "cpu"):
        assert main([*argv, "--device", device]) == 0
        docs[device] = json.loads(capsys.readouterr().out)
    mib = 2**20
    budget = {
        d: doc["search"]["best"]["config"]["tiered"]["tiers"]["cpu"]["budget"] for d, doc in docs.items()
    }
    host = {d: doc["search"]["best"]["peaks_bytes"]["host"] for d, doc in docs.items()}
    # without a GPU the "gpu" tier (here the parameters and gradients, homed there) is host memory
    # too ([Note: compute memory on a CPU-only machine]): counted in the host figure, off the budget
    needs = {d: doc["search"]["best"]["needs"] for d, doc in docs.items()}
    gpu_tier = needs["cpu"]["gpu"]["total"]
    assert gpu_tier > 0
    assert budget["cpu"] - budget["cuda"] == (1062 - 471) * mib - gpu_tier
    # beyond the host tiers' need (the GPU's room may step part of the state on cuda: [Note: the
    # GPU's room searched]), the process: the baselines' difference
    in_host = {"cuda": needs["cuda"]["cpu"]["total"], "cpu": needs["cpu"]["cpu"]["total"] + gpu_tier}
    assert (host["cuda"] - in_host["cuda"]) - (host["cpu"] - in_host["cpu"]) == (1062 - 471) * mib
    assert any(n.startswith("process baseline: 471") and "cpu process" in n for n in docs["cpu"]["assumed"])
    assert main(argv[:-1]) == 0  # the text, and cuda by default
    assert "process baseline: 1.04 GiB of host memory for a cuda process" in capsys.readouterr().out


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_plan_paper_vector_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "7.5e9", "--world-size", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    got = [round(s["gpu_model_state_bytes"] / 1e9, 1) for s in doc["strategies"][:4]]
    assert got == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_plan_nothing_fits_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--params", "400B", "--gpu-mem", "8GB", "--cpu-mem", "64GB", "--nvme-mem", "1TB"])
    assert code == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and "short by" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--params", "40B", "--gpu-mem", "80GX"], "--gpu-mem: unknown unit 'GX'"),
        (["plan", "--params", "40B", "--cpu-mem", "lots"], "--cpu-mem: cannot read 'lots'"),
        (["plan", "--params", "40B", "--nvme-mem", "-1"], "--nvme-mem: cannot read '-1'"),
        (["plan", "--params", "forty"], "--params: cannot read 'forty'"),
        (["plan", "--params", "40B", "--world-size", "0"], "--world-size must be >= 1"),
        (["plan", "--model", "does/not/exist"], "--model does/not/exist: no such file or folder"),
    ],
)
def test_bad_input_is_one_line_on_stderr_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert needle in err
    assert err.startswith("tiered plan: error: ")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan"]) == 2  # one of --params / --model is required
    assert "--params" in capsys.readouterr().err
    assert main(["plan", "--params", "1B", "--model", "x"]) == 2
    assert main(["no-such-command"]) == 2
    assert main([]) == 2


@pytest.mark.parametrize("cmd", [[], ["plan"], ["bench"], ["demo"]])
def test_help_exits_0_with_examples(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "tiered " in out


def test_missing_subcommand_module_does_not_break_others(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tiered.cli.main as cli

    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, ("ghost", "tiered.cli.ghost_not_here", "x")))
    assert main(["ghost"]) == 2
    err = capsys.readouterr().err
    assert "command 'ghost' is not available" in err and "tiered.cli.ghost_not_here" in err
    assert main(["plan", "--params", "1B", "--json"]) == 0


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tiered.cli.main", "plan", "--params", "1B", "--gpu-mem", "bad"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("tiered plan: error: --gpu-mem")
    assert "Traceback" not in proc.stderr


def test_plan_with_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=500, n_positions=64).save_pretrained(
        tmp_path
    )
    assert main(["plan", "--model", str(tmp_path), "--gpu-mem", "1GB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["largest_layer_params"] == 500 * 48
    assert doc["model"]["assumptions"] == []
    assert doc["recommended"]["offload_optimizer"] == "none"  # a tiny model fits on the GPU: fastest
    assert doc["config"]["tiered"]["tiers"]["gpu"]["budget"] <= 1e9
