"""`tiered run`: DeepSpeed's launcher flags -> the command and environment it starts (pure, every
flag without a GPU), and a real launch of one and of two processes whose ``deepspeed`` is
tiered's ([Note: tiered run as DeepSpeed's launcher])."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiered.cli.main import build_parser, main
from tiered.cli.run_plan import LaunchPlan, parse_hostfile, plan_launch, shim_dir
from tiered.errors import ConfigError, UnsupportedConfigError

ROOT = Path(__file__).resolve().parents[1]


def args_of(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def plan(*argv: str, devices: int = 0, environ: dict[str, str] | None = None) -> LaunchPlan:
    return plan_launch(args_of(*argv), device_count=devices, environ=environ or {})


def test_one_process_runs_the_script_with_the_launchers_environment() -> None:
    p = plan("train.py", "--deepspeed", "--deepspeed_config", "ds.json", environ={"PYTHONPATH": "/x"})
    assert p.argv == [
        sys.executable,
        "-u",
        "train.py",
        "--local_rank=0",
        "--deepspeed",
        "--deepspeed_config",
        "ds.json",
    ]
    assert p.env["PYTHONPATH"].split(os.pathsep) == [str(shim_dir()), "/x"]
    assert (shim_dir() / "deepspeed" / "__init__.py").is_file()
    assert {k: p.env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert int(p.env["MASTER_PORT"]) > 0 and "CUDA_VISIBLE_DEVICES" not in p.env
    assert plan("--master_port", "1234", "t.py").env["MASTER_PORT"] == "1234"


def test_more_processes_go_through_torchrun_with_each_local_rank() -> None:
    p = plan("--num_gpus", "2", "t.py", "--x", "a$b")
    assert p.argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in p.argv and "--standalone" in p.argv
    # torchrun substitutes ${local_rank}; the script's own '$' is escaped to arrive unchanged
    assert p.argv[-4:] == ["t.py", "--local_rank=${local_rank}", "--x", "a$$b"]
    assert p.world_size == 2 and p.env["LOCAL_SIZE"] == "2"
    fixed = plan("--num_gpus", "2", "--master_port", "29600", "t.py")
    assert "--master_port=29600" in fixed.argv and "--standalone" not in fixed.argv


def test_module_no_python_no_local_rank() -> None:
    assert plan("--module", "pkg.train").argv[:4] == [sys.executable, "-u", "-m", "pkg.train"]
    assert plan("--no_python", "./train.sh", "a").argv == ["./train.sh", "--local_rank=0", "a"]
    assert plan("--no_local_rank", "t.py", "a").argv == [sys.executable, "-u", "t.py", "a"]
    two = plan("--num_gpus", "2", "--module", "pkg.train").argv
    assert "--module" in two and two[-2:] == ["pkg.train", "--local_rank=${local_rank}"]
    assert "--no_python" in plan("--num_gpus", "2", "--no_python", "./t.sh").argv


def test_devices_include_exclude_and_visible_devices() -> None:
    assert plan("t.py", devices=4).nproc_per_node == 4
    assert plan("t.py", devices=4).env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    inc = plan("--include", "localhost:1,3", "t.py", devices=4)
    assert (inc.nproc_per_node, inc.env["CUDA_VISIBLE_DEVICES"]) == (2, "1,3")
    exc = plan("--exclude", "localhost:0", "t.py", devices=4)
    assert (exc.nproc_per_node, exc.env["CUDA_VISIBLE_DEVICES"]) == (3, "1,2,3")
    vis = plan("t.py", devices=2, environ={"CUDA_VISIBLE_DEVICES": "5,7"})
    assert (vis.nproc_per_node, vis.env["CUDA_VISIBLE_DEVICES"]) == (2, "5,7")
    assert plan("--num_gpus", "2", "t.py", devices=4).env["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(ConfigError, match=r"has no slot 4"):
        plan("--include", "localhost:4", "t.py", devices=4)
    with pytest.raises(ConfigError, match=r"host 'node9' is not in the resource pool"):
        plan("--include", "node9", "t.py", devices=4)
    with pytest.raises(ConfigError, match=r"--num_nodes / --num_gpus cannot be combined"):
        plan("--num_gpus", "1", "--include", "localhost:0", "t.py", devices=4)
    with pytest.raises(ConfigError, match=r"mutually exclusive"):
        plan("--include", "localhost:0", "--exclude", "localhost:1", "t.py", devices=4)


def test_hostfile_one_host_runs_here_several_need_no_ssh(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.write_text("# comment\nworker-0 slots=2\n")
    assert plan("--hostfile", str(one), "t.py", devices=2).nproc_per_node == 2
    two = tmp_path / "two"
    two.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    with pytest.raises(UnsupportedConfigError, match=r"--hostfile .* names 2 hosts .*--no_ssh --node_rank"):
        plan("--hostfile", str(two), "t.py", devices=2)
    p = plan(
        "--hostfile", str(two), "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1", "t.py", devices=2
    )
    assert (p.nnodes, p.node_rank, p.world_size) == (2, 1, 4)
    assert {"--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500"} <= set(p.argv)
    with pytest.raises(ConfigError, match=r"--master_addr"):
        plan("--hostfile", str(two), "--no_ssh", "--node_rank", "0", "t.py", devices=2)
    with pytest.raises(ConfigError, match=r"--node_rank"):
        plan("--hostfile", str(two), "--no_ssh", "--master_addr", "a", "t.py", devices=2)
    assert plan("--hostfile", str(two), "--num_nodes", "1", "t.py", devices=2).nnodes == 1
    with pytest.raises(ConfigError, match=r"--num_nodes 2 needs a --hostfile"):
        plan("--num_nodes", "2", "t.py")
    with pytest.raises(ConfigError, match=r"line 1: 'worker-0' is not 'HOST slots=N'"):
        parse_hostfile("worker-0\n", "h")


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--autotuning", "tune"], "--autotuning"),
        (["--elastic_training"], "--elastic_training"),
        (["--bind_cores_to_rank"], "--bind_cores_to_rank"),
        (["--bind_core_list", "0-3"], "--bind_core_list"),
        (["--force_multi"], "--force_multi"),
    ],
)
def test_flags_that_cannot_be_honoured_are_refused_by_name(flags: list[str], named: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=named):
        plan(*flags, "t.py")


def test_multi_node_runner_flags_warn_on_one_node() -> None:
    p = plan("--launcher", "openmpi", "--ssh_port", "2222", "t.py")
    assert any("--launcher" in w for w in p.warnings) and any("--ssh_port" in w for w in p.warnings)
    assert plan("t.py").warnings == ()


def test_a_missing_script_is_an_error_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert "nope.py does not exist" in capsys.readouterr().err


SCRIPT = """\
import argparse, os, sys
import deepspeed
from deepspeed import comm as dist
import deepspeed.comm
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam
import tiered.deepspeed
p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p = deepspeed.add_config_arguments(p)
a = p.parse_args()
deepspeed.init_distributed()
assert deepspeed is tiered.deepspeed and dist is tiered.deepspeed.comm and deepspeed.comm is dist
print(f"rank={dist.get_rank()} world={dist.get_world_size()} local_rank={a.local_rank} "
      f"env={os.environ['LOCAL_RANK']} config={a.deepspeed_config} device={get_accelerator().device_name()}")
"""


@pytest.mark.parametrize("ranks", [1, 2], ids=["one_process", "torchrun"])
def test_the_launched_script_imports_tiereds_deepspeed(tmp_path: Path, ranks: int) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "tiered.cli.main", "run", "--num_gpus", str(ranks), str(script)]
    proc = subprocess.run(
        [*cmd, "--deepspeed", "--deepspeed_config", "ds.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the ranks print to one pipe at once: a line may start before another's newline is written
    lines = sorted(
        re.findall(r"rank=\d+ world=\d+ local_rank=\d+ env=\d+ config=\S+ device=(?:cpu|cuda)", proc.stdout)
    )
    assert lines == [
        f"rank={r} world={ranks} local_rank={r} env={r} config=ds.json device=cpu" for r in range(ranks)
    ]


def test_exit_status_is_the_scripts(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    proc = subprocess.run(
        [sys.executable, "-m", "tiered.cli.main", "run", "--no_local_rank", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3
