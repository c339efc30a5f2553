"""The verdict of `tiered plan`: every strategy fit-checked, and the one to launch with.

The byte accounting is `accounting` ([Note: plan accounting]); turning the chosen strategy into a
config, or saying why nothing fits, is `recommend` ([Note: recommended config]). This module sits
above both, so the two never import each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tiered.planning.accounting import (
    RECOMMENDATION_ORDER,
    STRATEGIES,
    TIERS,
    Memories,
    ModelShape,
    PlanOptions,
    PrecisionBytes,
    StrategyPlan,
    check_fit,
    strategy_plan,
)
from tiered.planning.recommend import deepspeed_config, nothing_fits_message


@dataclass(frozen=True)
class Plan:
    """The whole answer of `tiered plan`, JSON-able via `to_json`."""

    shape: ModelShape
    memories: Memories
    options: PlanOptions
    strategies: tuple[StrategyPlan, ...]
    recommended: str | None
    message: str
    config: dict[str, Any] | None

    def strategy(self, key: str) -> StrategyPlan:
        for s in self.strategies:
            if s.key == key:
                return s
        raise KeyError(key)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": asdict(self.shape),
            "memories": asdict(self.memories),
            "options": asdict(self.options),
            "bytes_per_param": asdict(PrecisionBytes.of(self.options.precision)),
            "strategies": [s.to_json() for s in self.strategies],
            "recommended": self.recommended,
            "message": self.message,
            "config": self.config,
        }


def make_plan(shape: ModelShape, memories: Memories, opts: PlanOptions) -> Plan:
    """Every strategy of [Note: plan accounting], fit-checked, and the cheapest ZeRO-3 that fits."""
    strategies = tuple(check_fit(strategy_plan(*row, shape, opts), memories) for row in STRATEGIES)
    by_key = {s.key: s for s in strategies}
    chosen = next((k for k in RECOMMENDATION_ORDER if by_key[k].fits_all), None)
    if chosen is None:
        return Plan(
            shape,
            memories,
            opts,
            strategies,
            None,
            nothing_fits_message([by_key[k] for k in RECOMMENDATION_ORDER]),
            None,
        )
    s = by_key[chosen]
    unchecked = [t for t in TIERS if s.fits[t] is None]
    note = f"; not checked: {', '.join(unchecked)} (pass --{unchecked[0]}-mem)" if unchecked else ""
    if s.offload_optimizer == "none":
        how = "fits without offload"
    elif any(x.fits_all for x in strategies if x.offload_optimizer == "none"):
        how = "DP/ZeRO-1/2 without the ZeRO-3 working set would fit too"
    else:
        how = "fits only with offload"
    message = f"recommended: {s.name} (the cheapest ZeRO-3 placement that fits; {how}){note}"
    return Plan(
        shape, memories, opts, strategies, chosen, message, deepspeed_config(s, shape, memories, opts)
    )
