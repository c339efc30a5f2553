"""``deepspeed.moe.utils``: the helpers a script calls on its parameter groups, for models without
expert-parallel layers ([Note: MoE without expert parallelism])."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tiered.errors import UnsupportedConfigError

__all__ = [
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter marked as an expert's the way DeepSpeed's MoE layer marks it."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: Iterable[torch.nn.Parameter],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(shared, expert)``: without expert-parallel layers every parameter is shared."""
    shared: list[torch.nn.Parameter] = []
    expert: list[torch.nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float = 178956971,
) -> list[dict[str, Any]]:
    """DeepSpeed's: the groups as a list, each group's ``params`` a list (a generator is read
    once, as there). With no expert parameter that is all DeepSpeed's does too; an expert
    parameter is refused, as tiered has no expert group to put it in."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param group {i} is not a dict with 'params': {type(group).__name__}")
        group["params"] = list(group["params"])  # DeepSpeed also rewrites each group's params in place
        experts = [p for p in group["params"] if is_moe_param(p)]
        if experts:
            raise UnsupportedConfigError(
                f"param group {i} ({group.get('name', 'unnamed')}) holds {len(experts)} expert parameters "
                "(allreduce=False, as DeepSpeed's MoE layer marks them): tiered has no expert parallelism to "
                "give them a group of their own; build the experts as ordinary modules (no allreduce "
                "attribute) and declare their block a leaf module (tiered.zero.set_leaf_modules)"
            )
    return groups
