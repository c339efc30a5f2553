"""ZeRO-3 scheduling: flat shard groups, module hooks, trace-driven prefetch, gradient flush."""

from __future__ import annotations

from tiered.zero.grads import GradSummary
from tiered.zero.groups import ParamEntry, ShardGroup
from tiered.zero.params import ZeroParameters

__all__ = ["GradSummary", "ParamEntry", "ShardGroup", "ZeroParameters"]
