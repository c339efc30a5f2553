"""ZeRO-3 scheduling: flat shard groups, module hooks, trace-driven prefetch, gradient flush."""

from __future__ import annotations

from tiered.zero.coordinator import GradSummary, ZeroParameters

__all__ = ["GradSummary", "ZeroParameters"]
