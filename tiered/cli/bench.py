"""`tiered bench`: GB/s of the storage backends against an O_DIRECT ceiling, fio and DeepSpeed.

The measuring code is `tiered.bench.runner` ([Note: round-robin measurement]);
benchmarks/bandwidth.py calls the same code.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from tiered.errors import ConfigError
from tiered.units import parse_bytes

DESCRIPTION = """\
Measure write and cold-read bandwidth of tiered's file backends (nvme, aiofiles, tensorstore)
on the drive holding --dir, side by side with a plain O_DIRECT copy (8 threads x 8 MiB
pwritev/preadv: the ceiling every ratio is relative to), fio (if installed) and DeepSpeed's aio
handle (if deepspeed is installed and its async_io op is built). Each round runs every method
once in a rotated order; the table shows medians. Reads are cold (page cache dropped first),
writes include fsync, and every read is checked byte for byte.
"""

EPILOG = """\
examples:
  tiered bench --quick                       # 64 MiB, 2 rounds, in a temp dir: a smoke test
  tiered bench --dir /mnt/nvme0 --size 4GiB  # the drive you will offload to
  tiered bench --dir . --json bench.json --backends nvme aiofiles
  tiered bench --training --model ./my-model --config ds_config.json          # predicted GB/s per link
  tiered bench --training --model ./my-model --config ds_config.json --check  # ... and a real run beside it
  tiered bench --training --model ./my-model --config ds_config.json --tune best.json

needs about 2 x --size of free space in --dir (a subfolder is created and removed).
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="measure offload bandwidth of the storage backends",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_arguments(p)
    return p


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Shared with benchmarks/bandwidth.py."""
    p.add_argument(
        "--dir",
        metavar="DIR",
        default=None,
        help="directory on the drive to measure (default: the system temp directory)",
    )
    p.add_argument(
        "--size", metavar="SIZE", default=None, help="bytes per transfer, e.g. 1GiB (default 1GiB)"
    )
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up rounds (default 1)")
    p.add_argument(
        "--backends",
        nargs="+",
        default=None,
        metavar="NAME",
        help="registered tiered backends to measure, by name (default: nvme aiofiles tensorstore); "
        "files go under --dir",
    )
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="JSON",
        help='a full backend spec to measure as given, e.g. \'{"type": "stripe", "paths": ["/mnt/a", "/mnt/b"]}\' '
        "(repeatable; nested specs allowed; its own object is removed afterwards)",
    )
    p.add_argument("--no-fio", action="store_true", help="skip fio even if installed")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's aio handle")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 64MiB, 2 rounds, no warm-up, no DeepSpeed (override with --size/--rounds)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="measure every transfer size 4KiB, 16KiB, ... up to --max-size (each round-robin, median and spread)",
    )
    p.add_argument(
        "--max-size", metavar="SIZE", default=None, help="largest size of --sweep (default --size)"
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="with --sweep: GB/s vs size per method and direction, the ceiling drawn (needs matplotlib)",
    )
    p.add_argument(
        "--no-gpu-link",
        action="store_true",
        help="skip the GPU<->CPU link section (pinned and pageable copies, PCIe counters with pynvml; "
        "skipped by itself, with the reason, where no CUDA device exists)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the full result as JSON to FILE")
    p.add_argument("--quiet", "-q", action="store_true", help="no per-round progress on stderr")
    from tiered.cli.bench_training import add_training_arguments

    add_training_arguments(p)


def options_from_args(args: argparse.Namespace) -> Any:
    from tiered.bench.runner import DEFAULT_BACKENDS, BenchOptions

    quick = bool(args.quick)
    size = (
        parse_bytes(args.size, what="--size") if args.size is not None else (64 << 20 if quick else 1 << 30)
    )
    rounds = args.rounds if args.rounds is not None else (2 if quick else 5)
    specs = []
    for text in args.spec:
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--spec {text!r} is not valid JSON: {exc}") from exc
        if not isinstance(spec, dict) or "type" not in spec:
            raise ConfigError(f"--spec {text!r}: a backend spec is a JSON object with a 'type' key")
        specs.append(spec)
    backends = tuple(args.backends) if args.backends else (() if specs else DEFAULT_BACKENDS)
    return BenchOptions(
        directory=Path(args.dir) if args.dir is not None else Path(tempfile.gettempdir()),
        size_bytes=size,
        rounds=rounds,
        warmup_rounds=0 if quick else args.warmup,
        backends=backends,
        specs=tuple(specs),
        fio=not args.no_fio,
        deepspeed=not (args.no_deepspeed or quick),
    )


def make_progress(args: argparse.Namespace) -> Any:
    """A live bar on a terminal, plain lines elsewhere, nothing with --quiet (on stderr: the
    tables on stdout stay clean for a pipe)."""
    from tiered.bench.progress import BenchProgress

    return BenchProgress(sys.stderr, quiet=bool(args.quiet))


def measure(args: argparse.Namespace) -> Any:
    """Run the benchmark the arguments describe; returns a BenchResult."""
    from tiered.bench.runner import check_backends, run_bandwidth

    opts = options_from_args(args)
    check_backends(opts)  # a typo is an error (nearest name suggested) before anything is written

    progress = make_progress(args)
    try:
        return run_bandwidth(opts, progress=progress)
    finally:
        progress.close()


def _run_sweep(args: argparse.Namespace, out: TextIO) -> int:
    from tiered.bench.runner import check_backends
    from tiered.bench.sweep import run_sweep

    opts = options_from_args(args)
    check_backends(opts)
    max_bytes = parse_bytes(args.max_size, what="--max-size") if args.max_size else opts.size_bytes

    progress = make_progress(args)
    try:
        result = run_sweep(opts, max_bytes, progress=progress)
    finally:
        progress.close()
    out.write(result.to_markdown())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2) + "\n")
        out.write(f"\nJSON written to {args.json}\n")
    if args.plot:
        result.plot(Path(args.plot))
        out.write(f"plot written to {args.plot}\n")
    failed = sorted(
        {
            m.name
            for r in result.runs
            for m in r.methods
            if m.status == "error" and m.kind in ("ceiling", "backend")
        }
    )
    if failed:
        print(f"tiered bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from tiered.cli.bench_training import run_training, wants_training

    if wants_training(args):
        if args.sweep or args.plot:
            raise ConfigError(
                "--training replays one model's pattern: --sweep / --plot measure transfer sizes; use one or the other"
            )
        return run_training(args, out)
    if args.plot and not args.sweep:
        raise ConfigError("--plot draws GB/s against transfer size: add --sweep (and --max-size)")
    if args.sweep:
        return _run_sweep(args, out)
    result = measure(args)
    out.write(result.to_markdown())
    doc = result.to_json()
    if not args.no_gpu_link:
        from tiered.bench.gpu_link import measure_gpu_link

        gpu = measure_gpu_link(min(result.size_bytes, 1 << 30), rounds=result.rounds)
        out.write("\n" + gpu.to_markdown())
        doc["gpu_link"] = gpu.to_json()
    doc["compute"] = _compute_rate(out)  # tiered plan --bandwidth reads it ([Note: step time model])
    doc.update(_host_rates(result.size_bytes, result.rounds, out))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        out.write(f"\nJSON written to {args.json}\n")
    # The run failed if the ceiling could not be measured or any requested backend failed: a
    # failing backend is an error the caller (a script, CI) must see, not only a table cell.
    failed = [m.name for m in result.methods if m.status == "error" and m.kind in ("ceiling", "backend")]
    if not result.methods or result.methods[0].status != "ok" or failed:
        print(f"tiered bench: failed: {', '.join(failed) or 'no ceiling measured'}", file=sys.stderr)
        return 1
    return 0


def _host_rates(size_bytes: int, rounds: int, out: TextIO) -> dict[str, Any]:
    """The CPU Adam's element rate and the host copy's GB/s ([Note: host rates measured]), for
    the Adam and the "gpu"-tier copy terms of `tiered plan`'s s/step."""
    from tiered.bench.host_rates import measure_cpu_adam, measure_host_copy

    adam = measure_cpu_adam(rounds=rounds)
    copy = measure_host_copy(size_bytes, rounds=rounds)
    if adam["available"]:
        out.write(f"CPU Adam: {adam['elements_per_s'] / 1e9:.3f}e9 elements/s ({adam['threads']} threads)\n")
    else:
        out.write(f"CPU Adam: not measured ({adam['detail']})\n")
    out.write(f"host memory copy: {copy['gbps']:.2f} GB/s\n")
    return {"cpu_adam": adam, "host_copy": copy}


def _compute_rate(out: TextIO) -> dict[str, Any]:
    """The matmul FLOP rate of the compute device here (`tiered.planning.timing.probe_flops`:
    bf16 on a GPU, fp32 on the CPU), for the compute term of `tiered plan`'s s/step."""
    import torch

    from tiered.planning.timing import compute_threads_beside_engine, probe_flops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # on a CPU the rate training gets beside the engine's threads ([Note: compute beside the
    # engine's threads]): the plan reads this entry as the compute term's rate
    threads = compute_threads_beside_engine() if device == "cpu" else None
    rate = probe_flops(device, dtype, threads=threads)
    on = f"{threads} of {torch.get_num_threads()} threads" if threads else "the GPU"
    out.write(f"\ncompute: {rate / 1e12:.3f} TFLOP/s ({dtype} matmul on {device}, {on})\n")
    return {
        "flops_per_s": rate,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        **({"threads": threads} if threads else {}),
    }
