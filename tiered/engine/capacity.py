"""The capacity check: every tier's need against its budget or free space, before training.

[Note: capacity check before training]
Every byte the engine will ever hold in a tier is known once the shard groups exist, so a budget
that cannot work is reported at `initialize`, never mid-step. Per tier the need is

    homes        sum of nbytes of the partitions whose home is the tier (params, fp32 grads,
                 fp32 master/exp_avg/exp_avg_sq: the specs `OffloadedAdam` creates them from,
                 `tiered.optim.placement.state_partition_specs`, so an fp32 master that *is* the
                 parameter is not counted twice), all resident for the whole run when the tier
                 is memory-like
    + gather     "gpu" only, when params live elsewhere: the largest module's non-persistent
                 groups gathered at once (full_numel x param bytes; x (1 + 1/world) with world > 1:
                 shard + full buffer) + every persistent group (resident for the whole run); the
                 ZeRO-3 scheduler computes these once, when it plans the groups
                 (`tiered.zero.budget.check_gather_budgets`, its `ZeroParameters.gpu_need`)
    + pipeline   the optimizer's staging buffers (`tiered.optim.placement.pipeline_bytes`):
                 buffer_count x the largest tile's states (3 x 4 B x at most sub_group_size
                 elements) + buffer_count x the largest groups' whole gradient and parameter
                 (4 B + param bytes) x shard_numel, of the bytes not at home in that tier

and a budget below it raises CapacityError with the numbers and what to change. The pre-flight
(`preflight`, from the module tree before any partition is written) adds to the gpu tier's what a ``stage3_max_live_parameters`` the
config sets keeps gathered beyond the largest module's gather, as the plan's GPU peak does
(`tiered.planning.needs.live_budget_shortfall`, [Note: the live budget searched]), and lists that
shortfall with the tiers' own. Beyond that the check is a lower bound: prefetching more than one
group is backpressured by the tier manager, never required.

A tier without a budget is checked against its backend's free space *now*, when the parameter
and gradient partitions exist already and hold their space: what it must still have free is the
partitions not yet created (the optimizer state), each as the backend stores it
(`StorageBackend.stored_bytes`: a file takes whole filesystem blocks), plus the buffers a memory
tier allocates later (gather, persistent, pipeline). Tiers on one filesystem are summed against
its one free count. In-place (swap) files never grow after their first write, so a disk that
passes this check holds the run; a tier with atomic writes (a user-declared one) needs room for
the temp copy of each write in flight on top.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tiered.config.schema import TieredConfig
from tiered.errors import CapacityError, ConfigError
from tiered.planning.needs import TierNeed
from tiered.units import format_bytes

if TYPE_CHECKING:
    from tiered.tiers import Tier, TierManager


def preflight(model: torch.nn.Module, cfg: TieredConfig, tm: Any, *, world_size: int) -> None:
    """The capacity check from the module tree, before any partition is written: every tier
    short at once, then a config that fits the same budgets ([Note: one memory model],
    [Note: config search])."""
    from tiered.optim.placement import tier_is_host
    from tiered.planning.needs import live_budget_shortfall, predict

    gpu_is_host = tier_is_host(tm, "gpu")
    try:
        pred = predict(model, cfg, world_size=world_size, gpu_is_host=gpu_is_host)
    except (ConfigError, CapacityError):
        return  # ZeroParameters raises the same, with its own words
    gpu_budget = tm.tier("gpu").budget_bytes if "gpu" in tm.tier_names else None
    # [Note: the live budget searched]: the gathered bytes the plan's GPU peak counts
    live = live_budget_shortfall(pred, cfg.zero.max_live_parameters_numel, world_size, gpu_budget)
    try:
        check_budgets(tm, pred.needs, more=[live] if live else [])
    except CapacityError as exc:
        raise CapacityError(f"{exc}. {_fitting_config(model, cfg, tm, world_size, pred)}") from None


def _fitting_config(model: torch.nn.Module, cfg: TieredConfig, tm: Any, world_size: int, pred: Any) -> str:
    """The planner's fastest config within the budgets given, as JSON text, or what it lacks."""
    from tiered.optim.placement import tier_is_host
    from tiered.planning.candidate import plan_base
    from tiered.planning.search import Memories, search, shortfall_text

    def budget(name: str) -> int | None:
        return tm.tier(name).budget_bytes if name in tm.tier_names else None

    cpu = budget("cpu")
    mem = Memories(
        gpu=budget("gpu"),
        cpu=None if cpu is None else cpu + pred.host_extra_bytes,
        nvme=budget("nvme"),
    )
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(cfg.precision.dtype, "fp32")
    result = search(
        model,
        mem,
        base=plan_base(precision, cfg.gradient_accumulation_steps),
        nvme_path=cfg.zero.offload_optimizer.nvme_path or cfg.zero.offload_param.nvme_path,
        world_size=world_size,
        device_kind="cpu" if tier_is_host(tm, "gpu") else "cuda",
    )
    if result.best is None:
        near = result.closest
        return "No config fits these budgets" + (
            f"; the closest is short: {shortfall_text(near)}" if near else ""
        )
    z = result.best.config["zero_optimization"]
    t = result.best.config["tiered"]
    return "A config that fits these budgets (tiered plan's choice): " + json.dumps(
        {"zero_optimization": z, "tiered": t}
    )


def check_budgets(
    tm: TierManager, needs: dict[str, TierNeed], *, fitting: str = "", more: Sequence[str] = ()
) -> None:
    """Every tier with a budget below its need, and the shortfalls in `more` found by the caller
    (the live budget's), in one CapacityError (each with the keys that fix it, then `fitting`: a
    config that fits, from the planner). See [Note: capacity check before training]."""
    over = [
        _over_budget(name, tm.tier(name).budget_bytes or 0, d)
        for name, d in needs.items()
        if name in tm.tier_names
        and tm.tier(name).budget_bytes is not None
        and d["total"] > (tm.tier(name).budget_bytes or 0)
    ]
    over += more
    if over:
        raise CapacityError("; ".join(over) + (f". {fitting}" if fitting else ""))


def check_capacity(tm: TierManager, needs: dict[str, TierNeed]) -> None:
    """Raise CapacityError, before any training, when a budget, or the free space of a tier
    without one, is below what the run needs. See [Note: capacity check before training]."""
    free_space: dict[object, list[tuple[str, int]]] = {}
    for name, d in needs.items():
        tier = tm.tier(name)
        if tier.budget_bytes is None:
            free_space.setdefault(_space_of(tier), []).append((name, _still_needed(tier, d)))
            continue
        if d["total"] > tier.budget_bytes:
            raise CapacityError(_over_budget(name, tier.budget_bytes, d))
    for tiers in free_space.values():
        _check_free_space(tm, tiers)


def _still_needed(tier: Tier, d: TierNeed) -> int:
    """Bytes of free space the run takes from now on in a tier without a budget: the partitions
    not created yet, as the backend stores them, and the buffers memory tiers allocate later.
    The partitions written already (the parameters) hold their space: counting them again would
    refuse runs that fit."""
    b = tier.backend
    extra = d["gather"] + d["persistent"] + d["pipeline"]
    return sum(b.stored_bytes(n) for n in d["to_write"]) + extra


def _space_of(tier: Tier) -> object:
    """Tiers whose files share one filesystem share its free bytes: they are checked together."""
    directory = getattr(tier.backend, "directory", None)
    if directory is not None:
        try:
            return ("dev", os.stat(directory).st_dev)
        except OSError:
            pass
    return ("tier", tier.name)


def _check_free_space(tm: TierManager, tiers: list[tuple[str, int]]) -> None:
    first = tm.tier(tiers[0][0])
    try:
        free = first.backend.capacity().free_bytes
    except Exception:  # noqa: BLE001 - a backend that cannot tell: nothing to check
        free = None
    need = sum(n for _, n in tiers)
    if free is None or need <= free:
        return
    names = " + ".join(f"{n} bytes in tier {t!r}" for t, n in tiers)
    directory = getattr(first.backend, "directory", None)
    where = f" of {str(directory)!r}" if directory is not None else ""
    hint = (
        "free space there or point nvme_path at a larger disk"
        if directory is not None
        else f"set tiered.tiers.{tiers[0][0]}.budget or free space"
    )
    raise CapacityError(
        f"not enough free space{where} (tier {tiers[0][0]!r}, backend {first.backend.name!r}): the run "
        f"still writes {need} bytes ({format_bytes(need, binary=True)}: {names}; the partitions already "
        f"written are not counted again), only {free} bytes ({format_bytes(free, binary=True)}) are "
        f"free; {hint} (at least {need - free} more bytes)"
    )


def _over_budget(name: str, budget: int, d: TierNeed) -> str:
    parts = [f"{format_bytes(d['homes'], binary=True)} of partitions homed there"]
    if d["gather"]:
        parts.append(f"{format_bytes(d['gather'], binary=True)} to gather module {d['module']}")
    if d["persistent"]:
        parts.append(f"persistent {format_bytes(d['persistent'], binary=True)}")
    if d["pipeline"]:
        parts.append(f"{format_bytes(d['pipeline'], binary=True)} of optimizer pipeline buffers")
    hint = {
        "gpu": "raise tiered.tiers.gpu.budget, lower sub_group_size, or offload params/optimizer",
        "cpu": "raise tiered.tiers.cpu.budget, lower sub_group_size or offload_optimizer.buffer_count,"
        " or offload to nvme",
    }.get(name, f"raise tiered.tiers.{name}.budget or free space there")
    return (
        f"{name} budget {format_bytes(budget, binary=True)} < {format_bytes(d['total'], binary=True)} needed "
        f"({' + '.join(parts)}); {hint}"
    )
