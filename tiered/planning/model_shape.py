"""Where the plan's model numbers come from: a parameter count, or a Hugging Face config.

[Note: counting a model on the meta device]
`--model PATH` builds the model from its config inside ``torch.device("meta")``: every
parameter has a shape and no storage, so a 70B model is "built" in a second and nothing is
allocated. From it we read the exact total (tied weights counted once, as
``Module.parameters()`` does), the largest number of parameters one module owns directly (what
one ZeRO-3 fetch gathers) and the parameters at or under the persistence threshold (kept whole
on every rank).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered.config.read import default_of
from tiered.config.schema import ZeroConfig
from tiered.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """What `tiered plan` says of the model it plans, and where each number came from."""

    total_params: int
    largest_layer_params: int
    persistent_params: int
    source: str
    """Human text: "--params 40e9" or "model ./llama (LlamaForCausalLM)"."""
    assumptions: tuple[str, ...] = ()
    """Every number that was assumed rather than counted, in words."""
    trainable_params: int | None = None
    """Parameters that get gradients and optimizer state (LoRA adapters); None = all of them."""

    def __post_init__(self) -> None:
        if self.total_params <= 0:
            raise ConfigError(
                f"model from {self.source}: parameter count must be positive, got {self.total_params}"
            )
        if not 0 <= self.largest_layer_params <= self.total_params:
            raise ConfigError(
                f"model from {self.source}: largest layer ({self.largest_layer_params}) must be between 0 "
                f"and the total parameter count ({self.total_params})"
            )
        if self.trainable_params is not None and not 0 < self.trainable_params <= self.total_params:
            raise ConfigError(
                f"model from {self.source}: trainable parameters ({self.trainable_params}) must be between 1 and "
                f"the total parameter count ({self.total_params})"
            )


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


def shape_from_model(path: str | Path, *, persistence_threshold: int | None = None) -> ModelShape:
    """Count a local HF model (folder or config.json) on the meta device.

    See [Note: counting a model on the meta device].
    """
    from tiered.planning.hf_config import build_meta_model, resolve_model

    model = build_meta_model(resolve_model(path, weights=False))
    return shape_of_module(model, f"model {path} ({type(model).__name__})", persistence_threshold)


def shape_of_module(
    model: Any, source: str, persistence_threshold: int | None = None, assumptions: tuple[str, ...] = ()
) -> ModelShape:
    """The summary of a (meta) module: total, largest layer, persistent (at or under
    `persistence_threshold`, None: the config's default) and, where some are frozen, trainable."""
    threshold = (
        default_of(ZeroConfig, "param_persistence_threshold_numel")
        if persistence_threshold is None
        else persistence_threshold
    )
    total = sum(param.numel() for param in model.parameters())
    largest = max((sum(q.numel() for q in m.parameters(recurse=False)) for m in model.modules()), default=0)
    persistent = sum(q.numel() for q in model.parameters() if q.numel() <= threshold)
    trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
    log.debug("counted %s: %d params, largest layer %d", source, total, largest)
    # some frozen: a LoRA tree, or a wrapped model's other towers ([Note: wrapped models train
    # their language model]); none trainable counts as a full fine-tune's tree
    return ModelShape(
        total, largest, persistent, source, assumptions, trainable if 0 < trainable < total else None
    )
