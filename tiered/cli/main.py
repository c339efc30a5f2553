"""`tiered`: the command line. Each subcommand is a module with `add_parser(subparsers)` and `run(args)`.

[Note: CLI frame]
Subcommand modules are imported when the parser is built, each on its own: one that is missing
or fails to import (a command still being written, an optional dependency absent) leaves the
others working and answers its own name with the import error. Errors tiered raises on purpose
(`TieredError`) are the user's to fix, so they print as one line on stderr and exit 2, with no
traceback; anything else is a bug and keeps its traceback. argparse's own usage errors also
exit 2, `--help` exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from tiered import __version__
from tiered.errors import TieredError

COMMANDS: tuple[tuple[str, str, str], ...] = (
    # name, module, one-line help shown when the module cannot be imported
    ("plan", "tiered.cli.plan", "will it fit? memory per rank for DP and ZeRO-1/2/3 with offload"),
    ("finetune", "tiered.cli.finetune", "fine-tune a Hugging Face model with ZeRO-3 offload"),
    ("bench", "tiered.cli.bench", "measure offload bandwidth of the storage backends"),
    ("backends", "tiered.cli.backends", "list the registered storage backends"),
    ("demo", "tiered.cli.demo", "the main job on its default: plan a 40B model, then a quick bench"),
    ("build-ext", "tiered.cli.build_ext", "build the native Adam kernels once for this environment"),
    ("run", "tiered.cli.run", "run a DeepSpeed script unchanged on tiered (DeepSpeed's launcher flags)"),
)

EPILOG = """\
examples:
  tiered plan --params 40B --gpu-mem 80GB --cpu-mem 512GB --nvme-mem 4TB
  tiered plan --model ./my-llama --world-size 8 --gpu-mem 80GB --json
  tiered bench --dir /mnt/nvme0 --size 1GiB --json bench.json
  tiered backends
  tiered demo
  tiered build-ext
  tiered run --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json

Run `tiered COMMAND --help` for the options of one command.
"""


def _unavailable(name: str, reason: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        raise TieredError(f"command {name!r} is not available in this installation: {reason}")

    return run


def build_parser() -> argparse.ArgumentParser:
    """The full parser; each subparser carries `run` (the module's `run`) in its defaults."""
    parser = argparse.ArgumentParser(
        prog="tiered",
        description="tiered: train models larger than the GPU by keeping parameters, gradients and "
        "optimizer state in GPU memory, pinned CPU memory and NVMe files.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tiered {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - see [Note: CLI frame]
            if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
                reason = f"module {module_name} is not installed"
            else:
                reason = f"importing {module_name} failed: {type(exc).__name__}: {exc}"
            p = sub.add_parser(name, help=f"{help_text} (unavailable)", description=reason)
            p.set_defaults(run=_unavailable(name, reason))
            continue
        module.add_parser(sub)
        # Dispatch by name, so a command module need not set its own defaults.
        sub.choices[name].set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tiered` script. Returns the process exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) and usage errors (2)
        return int(exc.code) if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except TieredError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"tiered {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tiered {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
