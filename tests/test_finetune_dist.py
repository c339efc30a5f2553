"""`tiered finetune` and `tiered.initialize` under torchrun ([Note: process group from torchrun],
[Note: ranks in finetune]): 2 gloo ranks, each half of the global batch, equal 1 rank on the
whole batch, through the command line; a WORLD_SIZE > 1 without torchrun's variables is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from finetune_support import ds_config, write_jsonl, write_model

import tiered
from tiered.errors import ConfigError

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "finetune_dist_driver.py"


def _torchrun(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(DRIVER),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _run_one_rank(out: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(HERE))
    try:
        import finetune_dist_driver
    finally:
        sys.path.remove(str(HERE))
    import tiered.finetune as ft

    monkeypatch.setattr(ft, "train", ft.train)  # the driver replaces it; restore after the test
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert finetune_dist_driver.finetune(str(out), argv) == 0


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_two_gloo_ranks_equal_one_rank_on_the_same_global_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_model(tmp_path / "m")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the fast place {i} is small."} for i in range(40)])
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(tmp_path / "nvme", param="cpu", opt="cpu")))
    common = [
        "--model",
        str(model),
        "--config",
        str(cfg),
        "--data",
        str(data),
        "--seq-len",
        "16",
        "--steps",
        "3",
    ]

    one = tmp_path / "one.pt"
    _run_one_rank(
        one, [*common, "--batch-size", "4", "--stats-json", str(tmp_path / "one.json")], monkeypatch
    )
    two = tmp_path / "two.pt"
    proc = _torchrun(
        ["finetune", str(two), *common, "--batch-size", "2", "--stats-json", str(tmp_path / "two.json")],
        tmp_path,
    )

    a, b = torch.load(one), torch.load(two)
    assert len(b["losses"]) == 3
    for x, y in zip(a["losses"], b["losses"], strict=True):
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x))
    for name, want in a["state"].items():
        got = b["state"][name]
        assert float((got - want).norm()) <= 1e-5 * max(float(want.norm()), 1e-12), name
    stats = json.loads((tmp_path / "two.json").read_text())
    assert stats["tokens"] == 3 * 4 * 16  # the global batch: 2 ranks x 2 rows x 16 tokens per step
    assert stats["losses"] == pytest.approx(b["losses"])
    # only rank 0 prints: one header, one line per step
    assert proc.stdout.count("model: ") == 1 and proc.stdout.count("step     3/3") == 1
    assert "ranks: 2" in proc.stdout


def test_initialize_sets_up_the_process_group_under_torchrun(tmp_path: Path) -> None:
    _torchrun(["initialize", str(tmp_path / "seen.json")], tmp_path)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen.json.rank{rank}").read_text())
        assert seen == {"initialized": True, "backend": "gloo", "world_size": 2, "rank": rank}


def test_world_size_without_torchrun_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    model = torch.nn.Linear(4, 4)
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3},
    }
    with pytest.raises(ConfigError, match="init_process_group") as exc:
        tiered.initialize(model, cfg)
    assert "WORLD_SIZE=2" in str(exc.value) and "MASTER_ADDR" in str(exc.value)
