"""Planning: the memory model behind `tiered plan` (will it fit, and with which placement?).

Pure arithmetic over model shapes and memory sizes; the bandwidth harness is `tiered.bench`.
"""

from __future__ import annotations

from tiered.planning.accounting import Memories, ModelShape, PlanOptions, StrategyPlan
from tiered.planning.model_shape import parse_count, shape_from_model, shape_from_params
from tiered.planning.verdict import Plan, make_plan

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
