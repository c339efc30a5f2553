"""Offload bandwidth: tiered's file backends against an O_DIRECT ceiling, fio and DeepSpeed's aio.

Same code as `tiered bench` (tiered.bench.runner); see [Note: round-robin measurement].

    python benchmarks/bandwidth.py --dir /mnt/nvme0 --size 1GiB --json bandwidth.json
    python benchmarks/bandwidth.py --size 1GiB --write-results   # refresh "## Bandwidth" in RESULTS.md

Prints a markdown table (GB/s, medians over round-robin rounds, ratios to O_DIRECT).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

from tiered.cli.bench import add_bench_arguments, measure
from tiered.errors import TieredError

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADING = "## Bandwidth"


def section(result, command: str, load: tuple[float, float, float] | None = None) -> str:
    m = result.machine
    busy = (
        f" Load average (1/5/15 min) at the start: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}."
        if load
        else ""
    )
    return (
        f"{HEADING}\n\n"
        "Written by `benchmarks/bandwidth.py --write-results` (the same code as `tiered bench`).\n\n"
        f"Run {result.date} on {m['processor']} x {m['cpu_count']} CPUs, {m['platform']}; torch {m['torch']}; "
        f"directory on {result.filesystem}.{busy}\n\n"
        f"Command: `{command}`\n\n"
        "Each round runs every method once (write, then cold read), in an order rotated by one per round; "
        "GB/s = 1e9 B/s, median over rounds. Writes include fsync; reads follow posix_fadvise(DONTNEED) on the "
        "file and are checked byte for byte. Ratios are to the O_DIRECT thread-pool copy measured in the same "
        "rounds. fio's figures are fio's own (excluding its start-up).\n\n" + result.to_markdown()
    )


def write_section(path: Path, text: str, heading: str = HEADING) -> None:
    """Replace (or append) only the `heading` section ("## Bandwidth" by default); other sections
    stay as they are. benchmarks/nvme_pattern.py writes its own section through this too."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _m: text.rstrip("\n") + "\n\n", old, count=1)
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_arguments(parser)
    parser.add_argument(
        "--write-results",
        nargs="?",
        const=str(RESULTS),
        default=None,
        metavar="FILE",
        help=f"replace the '{HEADING}' section of FILE (default benchmarks/RESULTS.md)",
    )
    args = parser.parse_args(argv)
    if args.sweep or args.plot:  # shared flags this one-size report does not draw: never ignored
        parser.error("--sweep / --plot: run `tiered bench --sweep` (this script reports one --size)")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:
        result = measure(args)
    except TieredError as exc:
        print(f"bandwidth: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(result.to_markdown())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if args.write_results:
        # Paths are this machine's: the write-up shows placeholders (no machine-specific paths in docs).
        shown, hide = [], {"--dir": "DIR", "--json": "FILE", "--write-results": None}
        raw = list(argv if argv is not None else sys.argv[1:])
        for i, a in enumerate(raw):
            prev = raw[i - 1] if i else ""
            if prev in hide and not a.startswith("-"):
                if hide[prev] is not None:
                    shown.append(hide[prev])
                continue
            shown.append(a)
        command = "python benchmarks/bandwidth.py " + " ".join(shlex.quote(a) for a in shown)
        text = section(result, command.strip(), load).replace(result.directory, "DIR")
        write_section(Path(args.write_results), text)
        print(f"updated {HEADING!r} in {args.write_results}", file=sys.stderr)
    return 0 if result.methods and result.methods[0].status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
