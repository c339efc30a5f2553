"""``deepspeed.moe.layer``: `MoE`, refused when built ([Note: MoE without expert parallelism])."""

from __future__ import annotations

from typing import Any

import torch

from tiered.errors import UnsupportedConfigError

__all__ = ["MoE"]


class MoE(torch.nn.Module):
    """DeepSpeed's expert-parallel mixture-of-experts layer, which tiered does not have.

    Constructing it raises `UnsupportedConfigError` naming the difference and the alternative;
    the class exists so that ``deepspeed.moe.layer.MoE`` resolves and ``isinstance`` checks in
    ported code work."""

    def __init__(
        self, hidden_size: int = 0, expert: Any = None, num_experts: int = 1, ep_size: int = 1, **kwargs: Any
    ) -> None:
        raise UnsupportedConfigError(
            f"deepspeed.moe.layer.MoE(num_experts={num_experts}, ep_size={ep_size}): tiered has no expert "
            "parallelism (DeepSpeed shards the experts over an expert-parallel group and routes tokens with "
            "all-to-all; tiered keeps a ZeRO-3 shard of every expert on every rank). Build the experts and the "
            "gate as ordinary modules (an nn.ModuleList of experts and an nn.Linear router, or the model's own "
            "MoE block such as Hugging Face's Mixtral) and declare the block a leaf module: "
            "tiered.zero.set_leaf_modules(model, [Block]), deepspeed.utils.set_z3_leaf_modules, or "
            "zero_optimization.leaf_module in the config (docs/deepspeed.md)"
        )
