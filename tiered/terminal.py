"""The live progress bar of `tiered finetune` and `tiered bench`: one tqdm bar, sized for any
terminal ([Note: progress output] in tiered/finetune/progress.py says when a bar is shown).

tqdm is optional (``tiered[hf]`` brings it): `open_bar` raises ImportError without it, and each
caller falls back to plain lines.
"""

from __future__ import annotations

import os
from typing import Any, TextIO


def terminal_columns(stream: TextIO) -> int:
    """The width of the terminal behind `stream`; 0 when it reports none or is not a real one."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def open_bar(stream: TextIO, *, total: int, unit: str) -> Any:
    """A tqdm bar on `stream` (ImportError without tqdm). A terminal that reports a 0 x 0 size (a
    pty nobody sized: script(1), some CI runners) makes tqdm draw nothing at all, as it takes 0
    columns and 0 rows from it: such a terminal gets a fixed 120 x 24."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    sized = terminal_columns(stream) > 0
    return tqdm(
        total=total,
        file=stream,
        unit=unit,
        dynamic_ncols=sized,
        ncols=None if sized else 120,
        nrows=None if sized else 24,
        leave=True,
    )
