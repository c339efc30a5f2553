"""ZeRO-3 scheduling: flat shard groups, module hooks, trace-driven prefetch, gradient flush."""

from __future__ import annotations

from tiered.zero.coordinator import GradSummary, ZeroParameters
from tiered.zero.leaf import set_leaf_modules

__all__ = ["GradSummary", "ZeroParameters", "set_leaf_modules"]
