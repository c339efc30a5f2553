"""Where the plan's model numbers come from: a parameter count, or a Hugging Face config.

[Note: counting a model on the meta device]
`--model PATH` builds the model from its config inside ``torch.device("meta")``: every
parameter has a shape and no storage, so a 70B model is "built" in a second and nothing is
allocated. From it we read the exact total (tied weights counted once, as
``Module.parameters()`` does), the largest number of parameters one module owns directly (what
one ZeRO-3 fetch gathers) and the parameters at or under the persistence threshold (kept whole
on every rank).

[Note: assumed layer sizes]
With only `--params`, the largest layer is assumed to be 2 % of Ψ: the embedding or one MLP
matrix of a typical dense transformer (Llama-2-7B: 1.9 %, Llama-2-70B: 0.4 %; big-vocabulary
models such as Llama-3-8B reach 6.5 %: pass --largest-layer or --model for the real value).
Persistent parameters (norm weights, biases) are assumed to be 0.1 % of Ψ (GPT-2: 0.08 %,
Llama: < 0.01 %).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

from tiered.errors import ConfigError
from tiered.planning.accounting import ModelShape
from tiered.planning.model_sizes import MAX_PARAMS

log = logging.getLogger(__name__)

LARGEST_LAYER_FRACTION = 0.02
PERSISTENT_FRACTION = 0.001
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(value: int | float | str, *, what: str = "--params", maximum: int | None = None) -> int:
    """A parameter count: 40000000000, 40e9, "40e9", "40B", "7.5B", "350M", "1.5T" (B = billion).

    Raises ConfigError naming `what` and the offending text otherwise, or when it exceeds
    `maximum` (a model's count: [Note: plausible model sizes]).
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a parameter count such as 40B or 7.5e9, got {value!r}")
    if isinstance(value, int):
        number: float = value
        unit = ""
    elif isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str):
        match = _COUNT_RE.match(value)
        if not match or match.group(2).lower() not in _COUNT_UNITS:
            raise ConfigError(
                f"{what}: cannot read {value!r} as a parameter count; write e.g. 40B, 7.5e9, 350M or 1.5T "
                "(K, M, B/G, T = thousand, million, billion, trillion)"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ConfigError(f"{what}: expected a parameter count such as 40B or 7.5e9, got {value!r}")
    if math.isnan(number) or math.isinf(number) or number <= 0:
        raise ConfigError(f"{what}: {value!r} is not a positive parameter count")
    count = int(round(number * _COUNT_UNITS[unit]))
    if count < 1:
        raise ConfigError(f"{what}: {value!r} rounds to zero parameters")
    if maximum is not None and count > maximum:
        raise ConfigError(
            f"{what}: {value!r} is more than {maximum:.0e} parameters, more than any machine holds "
            f"({maximum * 2 / 1e15:g} PB in bf16); write the count, e.g. 40B or 7.5e9"
        )
    return count


def shape_from_params(
    params: int | float | str, *, largest_layer: int | float | str | None = None
) -> ModelShape:
    """A ModelShape from a bare count, with the assumptions of [Note: assumed layer sizes]."""
    total = parse_count(params, what="--params", maximum=MAX_PARAMS)
    assumptions: list[str] = []
    if largest_layer is None:
        big = max(1, int(total * LARGEST_LAYER_FRACTION))
        assumptions.append(
            f"largest layer assumed {LARGEST_LAYER_FRACTION:.0%} of the parameters ({big:,}); "
            "pass --largest-layer or --model for the real value"
        )
    else:
        big = parse_count(largest_layer, what="--largest-layer", maximum=MAX_PARAMS)
        if big > total:
            raise ConfigError(f"--largest-layer ({big:,}) cannot exceed --params ({total:,})")
    persistent = int(total * PERSISTENT_FRACTION)
    assumptions.append(
        f"persistent small parameters (norms, biases) assumed {PERSISTENT_FRACTION:.1%} ({persistent:,})"
    )
    return ModelShape(total, big, persistent, f"--params {params}", tuple(assumptions))


def shape_from_model(path: str | Path, *, persistence_threshold: int = 100_000) -> ModelShape:
    """Count a local HF model (folder or config.json) on the meta device.

    See [Note: counting a model on the meta device].
    """
    from tiered.planning.hf_config import build_meta_model, resolve_model

    model = build_meta_model(resolve_model(path, weights=False))
    return shape_of_module(model, f"model {path} ({type(model).__name__})", persistence_threshold)


def shape_of_module(model: Any, source: str, persistence_threshold: int = 100_000) -> ModelShape:
    """The ZeRO-formula summary of a (meta) module: total, largest layer, persistent."""
    total = sum(param.numel() for param in model.parameters())
    largest = max((sum(q.numel() for q in m.parameters(recurse=False)) for m in model.modules()), default=0)
    persistent = sum(q.numel() for q in model.parameters() if q.numel() <= persistence_threshold)
    log.debug("counted %s: %d params, largest layer %d", source, total, largest)
    return ModelShape(total, largest, persistent, source, ())
