"""`tiered run`: DeepSpeed's launcher on tiered. ``tiered run [deepspeed's launcher flags] train.py
[args]`` runs a DeepSpeed script unchanged: every ``deepspeed`` import in it is tiered's, ranks
start through torchrun ([Note: tiered run as DeepSpeed's launcher] in tiered/cli/run_plan.py)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from types import FrameType

from tiered.cli.run_plan import LaunchPlan, plan_launch
from tiered.errors import ConfigError

log = logging.getLogger(__name__)

DESCRIPTION = """\
Run a DeepSpeed training script on tiered, with no line of it changed: `tiered run` takes the
flags of DeepSpeed's `deepspeed` launcher, starts one process per device (through torchrun for
more than one; CUDA_VISIBLE_DEVICES, RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
--local_rank=N as DeepSpeed's launcher sets them), and makes `import deepspeed`, `from deepspeed
import comm`, `from deepspeed.ops.adam import DeepSpeedCPUAdam` and every other deepspeed import
in those processes tiered's DeepSpeed API, whether DeepSpeed is installed or not. The script's own
arguments (--deepspeed --deepspeed_config ds.json, ...) pass through as they are.
"""

EPILOG = """\
examples:
  tiered run train.py --deepspeed --deepspeed_config ds_config.json
  tiered run --num_gpus 2 cifar10_deepspeed.py --deepspeed --stage 3
  tiered run --include localhost:1,3 train.py ...
  tiered run --no_ssh --num_nodes 2 --node_rank 0 --master_addr 10.0.0.1 --hostfile hosts train.py ...

Refused, naming the flag: a multi-host --hostfile without --no_ssh (pdsh/ssh/MPI/SLURM launches),
--force_multi, --autotuning, --elastic_training, --bind_cores_to_rank. docs/deepspeed.md has the details.
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="run a DeepSpeed script unchanged on tiered (DeepSpeed's launcher flags)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # DeepSpeed's launcher flags, with its spellings and defaults (deepspeed/launcher/runner.py)
    p.add_argument("-H", "--hostfile", default=None, help="MPI-style hostfile ('HOST slots=N' lines)")
    p.add_argument("-i", "--include", default="", help="NODE_SPEC[@NODE_SPEC...], NODE_SPEC=NAME[:SLOT,...]")
    p.add_argument("-e", "--exclude", default="", help="devices not to use, as --include")
    p.add_argument("--num_nodes", type=int, default=-1, help="number of nodes (the first N of the hostfile)")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, help="processes per node")
    p.add_argument("--master_port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--master_addr", default="", help="address of node 0 (default 127.0.0.1 on one node)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank (with --no_ssh)")
    p.add_argument("--no_ssh", action="store_true", help="start only this node's ranks (run on every node)")
    p.add_argument("--module", action="store_true", help="the script is a module (python -m)")
    p.add_argument(
        "--no_python", action="store_true", help="run the script as an executable, not with python"
    )
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    p.add_argument(
        "--save_pid", action="store_true", help="write this launcher's pid to TMPDIR/<pid>.deepspeed"
    )
    p.add_argument(
        "--enable_each_rank_log",
        default="None",
        metavar="DIR",
        help="each rank's stdout/stderr into files under DIR",
    )
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("-q", "--quiet", action="store_true", help="as --log_level error")
    # DeepSpeed's flags that tiered run refuses or that only its multi-node runners use
    p.add_argument("--launcher", default="pdsh", help=argparse.SUPPRESS)
    p.add_argument("--launcher_args", default="", help=argparse.SUPPRESS)
    p.add_argument("--ssh_port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--venv_script", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no_ssh_check", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--force_multi", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--autotuning", default="", choices=["", "tune", "run"], help=argparse.SUPPRESS)
    p.add_argument("--elastic_training", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--bind_cores_to_rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind_core_list", default=None, help=argparse.SUPPRESS)
    p.add_argument("user_script", help="the training script (a module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's arguments, passed as they are")
    return p


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_script(args: argparse.Namespace) -> None:
    if args.module:
        return
    if args.no_python:
        if shutil.which(args.user_script) is None:
            raise ConfigError(f"tiered run --no_python {args.user_script}: no such executable")
        return
    if not Path(args.user_script).is_file():
        raise ConfigError(f"tiered run: the script {args.user_script} does not exist")


def run(args: argparse.Namespace) -> int:
    logging.getLogger("tiered").setLevel("ERROR" if args.quiet else args.log_level.upper())
    _check_script(args)
    plan = plan_launch(args, device_count=_device_count(), environ=os.environ)
    for line in plan.warnings:
        log.warning(line)
    log.info(
        "tiered run: %d process(es) on %d node(s), this node %d: %s",
        plan.nproc_per_node,
        plan.nnodes,
        plan.node_rank,
        " ".join(plan.argv),
    )
    pid_file = _save_pid() if args.save_pid else None
    try:
        return _launch(plan)
    finally:
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)


def _save_pid() -> Path:
    """DeepSpeed's --save_pid: a file named after this launcher's pid, holding it."""
    path = Path(tempfile.gettempdir()) / f"{os.getpid()}.deepspeed"
    path.write_text(str(os.getpid()))
    return path


def _launch(plan: LaunchPlan) -> int:
    """Start the plan's command, forward SIGINT/SIGTERM to it, and return its exit status (128 +
    the signal's number when a signal ended it, as a shell reports it)."""
    proc = subprocess.Popen(plan.argv, env=plan.env)

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signum)

    main = threading.current_thread() is threading.main_thread()  # handlers only install there
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code
