"""Turn the chosen placement into a config a user can launch with, or say why nothing fits.

[Note: recommended config]
The config is DeepSpeed's format (so it works unchanged with DeepSpeed too) plus a "tiered"
section with one entry per tier: its backend spec and a hard byte budget. A budget is the plan's
need on that tier plus 10 % headroom, rounded up to whole GiB and capped at what the user said
the tier has (the headroom absorbs allocator slack and the small buffers the plan does not
itemise). Element counts follow the plan's own choices: the prefetch bucket and live-parameter
cap are sized from the largest layer, so the working set of [Note: plan accounting] is what the
scheduler is allowed to hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tiered.planning.accounting import Memories, ModelShape, PlanOptions, StrategyPlan
from tiered.units import format_bytes

HEADROOM = 1.10
_TIER_BACKEND = {"gpu": "gpu", "cpu": "cpu", "nvme": "nvme"}


def _label(tier: str) -> str:
    return {"gpu": "GPU", "cpu": "CPU", "nvme": "NVMe"}.get(tier, tier)


def tier_budget(need_bytes: int, have_bytes: int | None) -> str:
    """Budget text for one tier. See [Note: recommended config]."""
    gib = max(1, math.ceil(need_bytes * HEADROOM / 2**30))
    if have_bytes is not None:
        gib = min(gib, max(1, have_bytes // 2**30))
    return f"{gib}GiB"


def deepspeed_config(s: StrategyPlan, shape: ModelShape, mem: Memories, opts: PlanOptions) -> dict[str, Any]:
    """DeepSpeed JSON (stage 3 + offload devices) with a "tiered" tier section."""
    big = max(1, shape.largest_layer_params)
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": opts.sub_group_size,
        "stage3_prefetch_bucket_size": big * opts.prefetch_layers,
        "stage3_max_live_parameters": big * (1 + opts.prefetch_layers),
        "stage3_param_persistence_threshold": opts.persistence_threshold,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if s.offload_optimizer != "none":
        off: dict[str, Any] = {"device": s.offload_optimizer, "pin_memory": True}
        if s.offload_optimizer == "nvme":
            off.update(nvme_path=opts.nvme_path, buffer_count=4)
        zero["offload_optimizer"] = off
    if s.offload_param != "none":
        offp: dict[str, Any] = {"device": s.offload_param, "pin_memory": True}
        if s.offload_param == "nvme":
            # buffer_size must hold the largest parameter (DeepSpeed #3506 is the failure otherwise).
            offp.update(
                nvme_path=opts.nvme_path,
                buffer_count=opts.param_buffer_count,
                buffer_size=max(100_000_000, big),
            )
        zero["offload_param"] = offp
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    if opts.precision in ("bf16", "fp16"):
        config[opts.precision] = {"enabled": True}
    config["zero_optimization"] = zero
    if "nvme" in (s.offload_optimizer, s.offload_param):
        config["aio"] = {
            "block_size": 1_048_576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        }
    tiers: dict[str, Any] = {}
    for tier in ("gpu", "cpu", "nvme"):
        need = s.bytes_on(tier)
        if not need:
            continue
        backend: dict[str, Any] = {"type": _TIER_BACKEND[tier]}
        if tier == "nvme":
            backend["path"] = opts.nvme_path
        tiers[tier] = {"backend": backend, "budget": tier_budget(need, mem.of(tier))}
    config["tiered"] = {"tiers": tiers}
    if s.grad_tier != "cpu":
        config["tiered"]["grad_tier"] = s.grad_tier  # [Note: gradients on nvme]
    return config


def nothing_fits_message(candidates: Sequence[StrategyPlan]) -> str:
    """Name the ZeRO-3 placement closest to fitting and how many bytes each tier lacks."""
    closest = min(candidates, key=lambda s: (sum(s.shortfall_bytes.values()), candidates.index(s)))
    lacks = ", ".join(
        f"{_label(tier)} short by {format_bytes(b)}" for tier, b in closest.shortfall_bytes.items()
    )
    return (
        f"nothing fits: even the closest placement, {closest.name}, needs more memory ({lacks}). "
        "Add memory on those tiers, use more ranks (--world-size), or a smaller model."
    )
