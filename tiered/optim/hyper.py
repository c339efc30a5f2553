"""Per-parameter hyper-parameters of the offloaded Adam (DeepSpeed's / torch's param groups)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamHyper:
    """One parameter's own weight decay and lr multiplier (its param group's lr / the base lr)."""

    weight_decay: float
    lr_scale: float = 1.0
