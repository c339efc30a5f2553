"""Build (or load from cache) the native kernels once and say which path is active.

    python -m tiered_ext.build [--quiet]        (the same as `tiered build-ext`)

Exit status 0 when the native CPU Adam is active, 1 when the reference fallback runs. The build
goes to this environment's kernel cache ([Note: one kernel cache per environment] in
tiered_ext/_cache.py; TIERED_EXT_CACHE moves it), where every later run finds it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import TextIO

from . import _loader, kernel_info


def build(out: TextIO, quiet: bool = False) -> int:
    """Build or load the kernels, write the status line (and, unless quiet, the cache folder)."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")  # the status line below carries the same message
        info = kernel_info()
    out.write(
        f"tiered_ext: cpu_adam={info['cpu_adam']} gpu_adam={info['gpu_adam']} threads={info['threads']}\n"
    )
    if not quiet:
        out.write(f"tiered_ext: CPU Adam cache folder {_loader.cpu_build()[1]}\n")
    return 0 if str(info["cpu_adam"]).startswith("native") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiered_ext.build", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quiet", action="store_true", help="print only the status line (and the build announcement)"
    )
    args = parser.parse_args(argv)
    # WARNING even when quiet: the announcement of a build that takes minutes is always shown.
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    return build(sys.stdout, quiet=args.quiet)


if __name__ == "__main__":
    sys.exit(main())
