"""``deepspeed.moe``: what a ported script without expert parallelism touches.

[Note: MoE without expert parallelism]
DeepSpeed's ``deepspeed.moe.layer.MoE`` shards experts over an expert-parallel group (``ep_size``)
and routes tokens between ranks with all-to-all; its parameters are marked (``allreduce =
False``, a ``group_name``) so ZeRO reduces them over that group only, and
``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`` moves them into
optimizer groups of their own. tiered has no expert parallelism: every rank holds a ZeRO-3 shard
of every parameter, experts included. So ``MoE`` is refused when built, naming the alternative
(the experts and the gate as ordinary modules, the block declared a leaf module so that ranks
routing to different experts agree on the order of collectives, [Note: leaf modules]); and the
group splitter passes groups through unchanged when no parameter is an expert parameter, which is
what scripts such as DeepSpeedExamples' CIFAR do by default (``--moe-param-group`` on a model
without MoE layers). A parameter that is marked as an expert's anyway (built by DeepSpeed's
layer, or marked by hand) is refused there too: splitting it off would need the expert group
tiered lacks.
"""

from __future__ import annotations

from tiered.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
