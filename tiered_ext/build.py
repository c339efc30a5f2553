"""Build (or load from cache) the native kernels once and say which path is active.

    python -m tiered_ext.build [--quiet]

Exit status 0 when the native CPU Adam is active, 1 when the reference fallback runs.
TORCH_EXTENSIONS_DIR chooses the cache directory (dev.sh: .cache/torch_extensions).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from . import kernel_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiered_ext.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="print only the one status line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL if args.quiet else logging.INFO, format="%(message)s")
    with warnings.catch_warnings():
        if args.quiet:
            warnings.simplefilter("ignore")  # the status line below carries the same message
        info = kernel_info()
    sys.stdout.write(
        f"tiered_ext: cpu_adam={info['cpu_adam']} gpu_adam={info['gpu_adam']} threads={info['threads']}\n"
    )
    return 0 if str(info["cpu_adam"]).startswith("native") else 1


if __name__ == "__main__":
    sys.exit(main())
