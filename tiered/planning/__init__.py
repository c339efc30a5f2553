"""Planning: the memory model behind `tiered plan` and the bandwidth measurement behind `tiered bench`.

The bandwidth code (tiered.planning.bandwidth_run) imports torch; import it directly.
"""

from __future__ import annotations

from tiered.planning.memory import Memories, ModelShape, Plan, PlanOptions, StrategyPlan, make_plan
from tiered.planning.model_shape import parse_count, shape_from_model, shape_from_params

__all__ = [
    "Memories",
    "ModelShape",
    "Plan",
    "PlanOptions",
    "StrategyPlan",
    "make_plan",
    "parse_count",
    "shape_from_model",
    "shape_from_params",
]
