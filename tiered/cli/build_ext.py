"""`tiered build-ext`: build tiered's native kernels now, into this environment's cache, so that no
run builds them in its first optimizer step ([Note: one kernel cache per environment] in
tiered_ext/_cache.py). ./dev.sh runs it in its set-up."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        "build-ext",
        help="build the native CPU (and CUDA) Adam kernels once for this environment",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )


def run(args: argparse.Namespace) -> int:
    from tiered_ext.build import build

    return build(sys.stdout)
