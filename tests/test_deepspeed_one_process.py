"""``python train.py`` with no launcher: a DeepSpeed script run as one plain process (no RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; maybe the ``--local_rank`` a launcher would
pass) gets a world of one and DeepSpeed's environment ([Note: one process without a launcher]).
Each case runs in a fresh interpreter with those variables stripped, as a user's shell has them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")

SCRIPT = """
import argparse, json, os, sys
import torch
import tiered.deepspeed as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--init-first", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
if args.init_first:
    deepspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
loss = engine(torch.randn(2, 4)).square().mean()
engine.backward(loss)
engine.step()
torch.distributed.barrier()
t = torch.ones(1)
deepspeed.comm.all_reduce(t)
print(json.dumps({
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
    "backend": torch.distributed.get_backend(),
    "rank": deepspeed.comm.get_rank(), "world": deepspeed.comm.get_world_size(),
    "local_rank": engine.local_rank, "sum": t.item(), "steps": engine.global_steps,
}))
"""

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3},
}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU, as on a machine without a GPU
    env.update(extra)
    return env


def run(tmp_path: Path, *argv: str, **extra: str) -> dict[str, Any]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CONFIG))
    proc = subprocess.run(
        [sys.executable, str(script), "--deepspeed_config", str(cfg), *argv],
        env=clean_env(**extra),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize(
    "argv",
    [(), ("--local_rank", "0"), ("--local_rank=0", "--init-first")],
    ids=["plain", "local_rank_arg", "init_distributed_first"],
)
def test_a_plain_python_run_gets_a_world_of_one_and_deepspeeds_environment(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    got = run(tmp_path, *argv)
    assert (got["backend"], got["rank"], got["world"], got["local_rank"]) == ("gloo", 0, 1, 0)
    assert (got["sum"], got["steps"]) == (1.0, 1)
    env = got["env"]
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 0 < int(env["MASTER_PORT"]) < 65536


def test_a_master_port_the_user_set_is_kept(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port free now; only this test's process uses it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = run(tmp_path, MASTER_PORT=str(port))
    assert got["env"]["MASTER_PORT"] == str(port)
    assert (got["rank"], got["world"]) == (0, 1)
