"""What `tiered run` launches: DeepSpeed's launcher flags turned into one command and its
environment ([Note: tiered run as DeepSpeed's launcher]). Pure: the device count and the
environment come in as arguments, so every flag is testable without a GPU or a process.

[Note: tiered run as DeepSpeed's launcher]
``deepspeed [flags] train.py [args]`` (DeepSpeed's runner, then its ``launcher.launch``) picks
the devices of this node (``--num_gpus``, ``--include``/``--exclude``, a ``--hostfile``), starts
one process per device with the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; CUDA_VISIBLE_DEVICES to the chosen slots) and passes each its
``--local_rank=N`` first among the script's arguments. `tiered run` takes the same flags and does
the same through torchrun: one process runs the script directly (as ``python -u``), more go through
``torch.distributed.run``, which passes ``--local_rank=${local_rank}`` (torchrun substitutes each
worker's local rank into its arguments; a ``$`` of the script's own arguments is escaped so that
it arrives unchanged). Every process gets the ``deepspeed`` stand-in first on PYTHONPATH, so the
script's DeepSpeed imports are tiered's ([Note: deepspeed as an alias of tiered.deepspeed]).

Differences, each on purpose: without ``--master_port`` the port is a free one the kernel picks
(torchrun's ``--standalone``; one process: a port bound and released just before the start),
not DeepSpeed's fixed 29500 that any other run on the machine collides with. A hostfile is read
only when given (DeepSpeed also reads ``/job/hostfile`` when it exists). What needs DeepSpeed's
multi-node runners (pdsh, ssh, MPI, SLURM: a hostfile naming several hosts without
``--no_ssh``, ``--force_multi``), its autotuner, its elastic training, or core binding is
refused, naming the flag and what to run instead; multi-node runs start with ``--no_ssh
--node_rank R`` on each node, as DeepSpeed's own ``--no_ssh`` mode does. The flags of the
multi-node runners only (``--launcher``, ``--launcher_args``, ``--ssh_port``, ``--venv_script``,
``--no_ssh_check``) do nothing on one node, in DeepSpeed too; tiered says so in a warning.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tiered.errors import ConfigError, UnsupportedConfigError

__all__ = ["LaunchPlan", "parse_hostfile", "plan_launch", "shim_dir"]

SSH_ONLY_FLAGS = ("launcher", "launcher_args", "ssh_port", "venv_script", "no_ssh_check")
"""Flags of DeepSpeed's multi-node runners only: no effect on a one-node launch (there too)."""


@dataclass(frozen=True)
class LaunchPlan:
    """The command `tiered run` starts, its environment, and what it decided."""

    argv: list[str]
    env: dict[str, str]
    nproc_per_node: int
    nnodes: int
    node_rank: int
    warnings: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def shim_dir() -> Path:
    """The folder with the ``deepspeed`` stand-in (tiered/deepspeed/shim), found without importing
    tiered.deepspeed: importing it would make ``deepspeed`` tiered's in this process too."""
    spec = importlib.util.find_spec("tiered.deepspeed")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "shim"


def parse_hostfile(text: str, path: str) -> collections.OrderedDict[str, int]:
    """DeepSpeed's hostfile (``worker-0 slots=4`` per line, ``#`` comments): host -> slot count."""
    pool: collections.OrderedDict[str, int] = collections.OrderedDict()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if m is None:
            raise ConfigError(f"--hostfile {path} line {n}: {line!r} is not 'HOST slots=N'")
        if m.group(1) in pool:
            raise ConfigError(f"--hostfile {path} line {n}: host {m.group(1)} is listed twice")
        pool[m.group(1)] = int(m.group(2))
    if not pool:
        raise ConfigError(f"--hostfile {path} lists no host ('HOST slots=N' lines)")
    return pool


def _node_specs(spec: str, flag: str) -> dict[str, list[int]]:
    """``NAME[:SLOT[,SLOT...]][@NAME...]`` -> host -> slots ([] = all of the host's)."""
    out: dict[str, list[int]] = collections.defaultdict(list)
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        if not host:
            raise ConfigError(f"{flag} {spec!r}: a node spec has no host name (NAME[:SLOT,...])")
        try:
            out[host] += [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise ConfigError(f"{flag} {spec!r}: slots must be integers (NAME:0,2)") from None
    return {h: sorted(set(s)) for h, s in out.items()}


def _filter(
    pool: Mapping[str, list[int]], include: str, exclude: str
) -> collections.OrderedDict[str, list[int]]:
    """DeepSpeed's --include / --exclude over host -> slots, keeping the pool's host order."""
    if include and exclude:
        raise ConfigError("--include and --exclude are mutually exclusive (as in DeepSpeed)")
    if not include and not exclude:
        return collections.OrderedDict((h, list(s)) for h, s in pool.items())
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in pool.items()}
    for host, slots in _node_specs(spec, flag).items():
        if host not in pool:
            raise ConfigError(
                f"{flag} {spec!r}: host {host!r} is not in the resource pool ({', '.join(pool)})"
            )
        for s in slots:
            if s not in pool[host]:
                raise ConfigError(f"{flag} {spec!r}: host {host!r} has no slot {s} (slots {pool[host]})")
        if include:
            chosen[host] = slots or list(pool[host])
        else:
            chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    return collections.OrderedDict((h, chosen[h]) for h in pool if chosen.get(h))


def _refuse_unsupported(args: argparse.Namespace) -> None:
    if args.autotuning:
        raise UnsupportedConfigError(
            f"--autotuning {args.autotuning}: DeepSpeed's autotuner is not part of tiered; `tiered plan --model DIR "
            "--gpu-mem ... --json` searches for the fastest config that fits and writes it"
        )
    if args.elastic_training or args.min_elastic_nodes != -1 or args.max_elastic_nodes != -1:
        raise UnsupportedConfigError(
            "--elastic_training / --min_elastic_nodes / --max_elastic_nodes: tiered has no elastic training; "
            "launch a fixed world (resume from a checkpoint with another world size: tiered reshards it)"
        )
    if args.bind_cores_to_rank or args.bind_core_list is not None:
        raise UnsupportedConfigError(
            "--bind_cores_to_rank / --bind_core_list: tiered run does not bind ranks to cores; run it under "
            "numactl or taskset (e.g. `numactl --cpunodebind=0 tiered run ...`)"
        )
    if args.force_multi:
        raise UnsupportedConfigError(
            "--force_multi: DeepSpeed's multi-node runners (pdsh/ssh/MPI/SLURM) are not part of tiered run; on "
            "each node run `tiered run --no_ssh --num_nodes N --node_rank R --master_addr ADDR ...`"
        )


def _pool(
    args: argparse.Namespace, device_count: int, environ: Mapping[str, str]
) -> tuple[dict[str, list[int]], bool]:
    """host -> slots before the filters, and whether they came from a hostfile."""
    if args.hostfile:
        try:
            text = Path(args.hostfile).read_text()
        except OSError as exc:
            raise ConfigError(f"--hostfile {args.hostfile}: cannot be read ({exc.strerror})") from None
        return {h: list(range(n)) for h, n in parse_hostfile(text, args.hostfile).items()}, True
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if device_count > 0 and visible:
        ids = [int(v) for v in visible.split(",") if v.strip().lstrip("-").isdigit()]
        return {"localhost": ids[:device_count]}, False
    return {"localhost": list(range(max(1, device_count)))}, False


def plan_launch(args: argparse.Namespace, *, device_count: int, environ: Mapping[str, str]) -> LaunchPlan:
    """The command and environment for `args` (the `tiered run` namespace) on a node with
    `device_count` CUDA devices (0: the CPU, one process unless --num_gpus says more)."""
    _refuse_unsupported(args)
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise ConfigError(
            "--num_nodes / --num_gpus cannot be combined with --include / --exclude (as in DeepSpeed)"
        )
    pool, from_hostfile = _pool(args, device_count, environ)
    if not from_hostfile and args.num_nodes > 1:
        raise ConfigError(
            f"--num_nodes {args.num_nodes} needs a --hostfile naming the nodes (as in DeepSpeed); run with --no_ssh "
            "--node_rank R on each of them"
        )
    active = _filter(pool, args.include, args.exclude)
    if not active:
        raise ConfigError("--include / --exclude left no device to run on")
    if args.num_nodes > 0:
        active = collections.OrderedDict(list(active.items())[: args.num_nodes])
    if args.num_gpus > 0:
        active = collections.OrderedDict((h, list(range(args.num_gpus))) for h in active)
    warnings = [
        f"--{flag} applies to DeepSpeed's multi-node runners only; it has no effect on this launch (nor in DeepSpeed)"
        for flag in SSH_ONLY_FLAGS
        if getattr(args, flag) not in (None, "", False, "pdsh")
    ]
    hosts = list(active)
    if len(hosts) > 1 and not args.no_ssh:
        raise UnsupportedConfigError(
            f"--hostfile {args.hostfile} names {len(hosts)} hosts ({', '.join(hosts)}): starting ranks on other hosts "
            "(pdsh/ssh/MPI/SLURM) is DeepSpeed's multi-node runner, which tiered run does not have; run `tiered run "
            f"--no_ssh --node_rank R --master_addr ADDR --hostfile {args.hostfile} ...` on each host, or torchrun"
        )
    node_rank = 0
    master_addr = args.master_addr or "127.0.0.1"
    if len(hosts) > 1:
        if not 0 <= args.node_rank < len(hosts):
            raise ConfigError(
                f"--no_ssh with {len(hosts)} nodes needs --node_rank in [0, {len(hosts)}), got {args.node_rank}"
            )
        if not args.master_addr:
            raise ConfigError("--no_ssh with several nodes needs --master_addr (the address of node 0)")
        counts = {h: len(s) for h, s in active.items()}
        if len(set(counts.values())) != 1:
            raise UnsupportedConfigError(
                f"nodes with different numbers of slots ({counts}): torchrun starts the same number of ranks on "
                "every node; give each node the same count (--num_gpus N)"
            )
        node_rank = args.node_rank
    slots = active[hosts[node_rank]]
    nproc, nnodes = len(slots), len(hosts)
    env = dict(environ)
    shim = str(shim_dir())
    env["PYTHONPATH"] = os.pathsep.join(
        [shim, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    if device_count > 0:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    # DeepSpeed's launcher sets these too (torchrun sets the per-rank ones)
    env.update(LOCAL_SIZE=str(nproc), CROSS_RANK=str(node_rank), CROSS_SIZE=str(nnodes))
    script = _script_command(args)
    local_rank = (
        []
        if args.no_local_rank
        else ["--local_rank=${local_rank}" if nproc * nnodes > 1 else "--local_rank=0"]
    )
    if nproc * nnodes == 1 and args.enable_each_rank_log in (None, "None"):
        for key in [k for k in env if k.startswith("TORCHELASTIC_")]:
            del env[key]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR=master_addr)
        env["MASTER_PORT"] = str(args.master_port) if args.master_port is not None else str(free_port())
        argv = [*script, *local_rank, *args.user_args]
        return LaunchPlan(argv, env, nproc, nnodes, node_rank, tuple(warnings))
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}"]
    if nnodes == 1 and args.master_port is None:
        run.append("--standalone")
    else:
        port = args.master_port if args.master_port is not None else 29500
        run += [f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={port}"]
    if args.enable_each_rank_log not in (None, "None"):
        run += [f"--log_dir={args.enable_each_rank_log}", "--redirects=3"]
    if args.no_python:
        run.append("--no_python")
    elif args.module:
        run.append("--module")
    escaped = [a.replace("$", "$$") for a in args.user_args]  # torchrun's ${local_rank} substitution
    argv = [*run, script[-1], *local_rank, *escaped]
    return LaunchPlan(argv, env, nproc, nnodes, node_rank, tuple(warnings))


def _script_command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.user_script]
    if args.module:
        return [sys.executable, "-u", "-m", args.user_script]
    return [sys.executable, "-u", args.user_script]


def free_port() -> int:
    """A port the kernel picks, released for the launched process to take (as torchrun's
    --standalone finds its own)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
