"""`tiered plan`'s checks of what it is given: the flags' argparse types and whether the model
can fit the memories at all."""

from __future__ import annotations

import argparse
import math
from typing import Any


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse names the flag in its error)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def positive_rate(text: str) -> float:
    """An argparse type: a finite rate > 0, e.g. 4e14 (a FLOP/s of 0, nan or inf predicts nothing)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate such as 4e14, got {text!r}") from None
    if not math.isfinite(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite rate > 0, e.g. 4e14, got {text!r}")
    return rate


def check_all_memory(shape: Any, given: dict[str, int | None], world_size: int, param_bytes: int) -> None:
    """With every tier's memory given, the model's weights alone must fit their sum (per rank:
    ZeRO-3 shards them over the ranks): else nothing can, and the search is not run
    ([Note: plausible model sizes])."""
    from tiered.planning.model_sizes import check_weights_fit

    if any(b is None for b in given.values()):
        return  # a tier not given is not checked: it may hold anything
    check_weights_fit(
        -(-shape.total_params // world_size),
        param_bytes,
        sum(b for b in given.values() if b is not None),
        "--gpu-mem + --cpu-mem + --nvme-mem per rank",
        shape.source,
    )
