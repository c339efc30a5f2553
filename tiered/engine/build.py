"""Building an engine's parts from a resolved config: tiers, placement, the capacity check.

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
(`tiered.engine.preflight`) adds to the gpu tier's what a ``stage3_max_live_parameters`` the
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

import logging
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tiered.config.schema import TieredConfig
from tiered.errors import AlreadyManagedError, CapacityError, ConfigError
from tiered.planning.homes import Placement
from tiered.planning.homes import choose_placement as _choose_placement
from tiered.planning.needs import TierNeed, capacity_needs, engine_needs
from tiered.units import format_bytes

__all__ = [
    "Placement",
    "build_tier_manager",
    "capacity_needs",
    "check_capacity",
    "check_not_managed",
    "choose_placement",
    "engine_needs",
    "mark_managed",
    "tier_order",
    "unmark_managed",
]

if TYPE_CHECKING:
    from tiered.storage.base import StorageBackend
    from tiered.tiers import Tier, TierManager

log = logging.getLogger(__name__)

_ORDER = ("gpu", "cpu", "nvme")
_DEVICE_TIER = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}


def choose_placement(cfg: TieredConfig) -> Placement:
    """Where the engine puts each kind of state (`tiered.planning.homes.choose_placement`), logged."""
    placement = _choose_placement(cfg)
    log.info("tiers used: %s", placement.describe(cfg))
    return placement


_MANAGED_ATTR = "_tiered_engine"


def check_not_managed(model: torch.nn.Module) -> None:
    """AlreadyManagedError when an open engine already manages `model`: two engines over one
    module would share its hooks and parameters, and the second would silently train nothing."""
    ref = model.__dict__.get(_MANAGED_ATTR)
    first = ref() if ref is not None else None
    if first is not None and not getattr(first, "_closed", True):
        raise AlreadyManagedError(
            f"tiered.initialize: module {type(model).__name__} is already managed by engine "
            f"{first!r} (id {id(first):#x}); use that engine, or call its close() first"
        )


_MANAGED_MODELS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Every model marked managed (weakly): the module-level DeepSpeed API finds a parameter's engine."""


def mark_managed(model: torch.nn.Module, engine: object) -> None:
    model.__dict__[_MANAGED_ATTR] = weakref.ref(engine)
    _MANAGED_MODELS.add(model)


def managed_models() -> list[tuple[torch.nn.Module, object]]:
    """(model, its open engine) for every model an engine manages now."""
    out = []
    for model in list(_MANAGED_MODELS):
        ref = model.__dict__.get(_MANAGED_ATTR)
        engine = ref() if ref is not None else None
        if engine is not None and not getattr(engine, "_closed", True):
            out.append((model, engine))
    return out


def unmark_managed(model: torch.nn.Module, engine: object) -> None:
    """`engine` closed: the module is an ordinary one again. The marker goes, so that nothing
    of tiered's is left on it (a weak reference would break ``torch.save(model)`` and
    ``copy.deepcopy``); a marker of a later engine stays."""
    ref = model.__dict__.get(_MANAGED_ATTR)
    if ref is not None and ref() in (engine, None):
        del model.__dict__[_MANAGED_ATTR]


def tier_order(names: Sequence[str]) -> list[str]:
    """Fastest first: gpu, cpu, nvme, then custom tiers in the order given."""
    known = [n for n in _ORDER if n in names]
    return known + [n for n in names if n not in _ORDER]


def check_trace_path(path: str | os.PathLike[str], what: str = "tiered.trace_path") -> None:
    """The trace is written at close, after the whole run: a path it cannot be written to is
    refused now, naming `what` (the key or flag that gave it)."""
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{what} = {os.fspath(path)!r}: folder {parent} does not exist; create it or choose another path "
            "(the trace is written when the engine closes)"
        )
    if os.path.isdir(target):
        raise ConfigError(f"{what} = {os.fspath(path)!r} is a folder; name a file in it, e.g. trace.json")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} = {os.fspath(path)!r}: folder {parent} is not writable by this user")


def build_tier_manager(cfg: TieredConfig, *, rank: int = 0, world_size: int = 1) -> TierManager:
    """Open every configured backend (entry points only: tiered never imports plugins/) and
    hand them, with their budgets, to one TierManager.

    With several ranks, a backend spec with a "path" gets a per-rank subdirectory
    (``<path>/rank<r>``): every rank names its partitions alike, so one shared nvme_path
    (the usual DeepSpeed config) must not make ranks overwrite each other's files. Swap
    backends (the derived offload tiers) need none: each process has its own swap folder."""
    from tiered.tiers import TierManager
    from tiered.tiers.io_policy import IOPolicy

    if cfg.tiered.trace_path is not None:
        check_trace_path(cfg.tiered.trace_path)
    specs = dict(cfg.tiered.tiers)
    for name in ("gpu", "cpu"):
        if name not in specs:
            raise ConfigError(f"tiered.tiers.{name} is missing: the engine needs a {name!r} tier")
    tiers: list[Tier] = []
    try:
        for name in tier_order(list(specs)):
            tiers.append(
                _open_tier(
                    name, specs[name], rank=rank, world_size=world_size, timeout_s=cfg.tiered.timeout_s
                )
            )
    except BaseException:
        # a later tier that fails (an unknown backend, a budget too big) must not leave the
        # swap folders of the tiers already opened behind
        _close_backends([(t.name, t.backend) for t in tiers], cfg.tiered.timeout_s)
        raise
    t = cfg.tiered
    policy = IOPolicy(
        timeout_s=t.timeout_s,
        floor_s=t.io_timeout_floor_s,
        min_bytes_per_s=t.io_min_bytes_per_s,
        retries=t.io_retries,
        backoff_s=t.io_retry_backoff_s,
        transient=t.io_retry_errno_codes,
    )
    return TierManager(
        tiers,
        timeout_s=t.timeout_s,
        io_threads=t.io_threads,
        record_trace=t.trace_path is not None,
        verify=t.verify_checksums,
        io_policy=policy,
    )


def _open_tier(name: str, spec: Any, *, rank: int, world_size: int, timeout_s: float) -> Tier:
    from tiered.storage import open_backend
    from tiered.tiers import Tier

    bspec = dict(spec.backend)
    # a swap backend already writes into a private per-process folder that close() removes;
    # a rank subfolder would only be left behind, empty
    per_rank = world_size > 1 and isinstance(bspec.get("path"), str) and not bspec.get("swap")
    if per_rank:
        bspec["path"] = os.path.join(bspec["path"], f"rank{rank}")
    try:
        if per_rank:
            os.makedirs(bspec["path"], mode=0o700, exist_ok=True)
        backend = open_backend(bspec)
    except (OSError, PermissionError) as e:
        path = spec.backend.get("path")
        raise ConfigError(
            f"tiered.tiers.{name}: cannot open backend {spec.backend.get('type')!r}"
            + (f" at {path!r}" if path else "")
            + f": {e}; point nvme_path at a writable directory"
        ) from e
    budget = spec.budget_bytes
    try:
        total = backend.capacity().total_bytes if budget is not None else None
    except Exception:  # noqa: BLE001 - a backend that cannot tell its size: nothing to compare
        total = None
    if budget is not None and total is not None and budget > total:
        _close_backends([(name, backend)], timeout_s)
        raise CapacityError(
            f"tiered.tiers.{name}.budget {format_bytes(budget, binary=True)} ({budget} bytes) is more than "
            f"backend {backend.name!r} has in all: {format_bytes(total, binary=True)} ({total} bytes); "
            "lower the budget, or leave it out to use what the backend reports free"
        )
    return Tier(name=name, backend=backend, budget_bytes=budget)


def _close_backends(backends: Sequence[tuple[str, StorageBackend]], timeout_s: float) -> None:
    """Close backends from synchronous code, on a thread with its own loop (the caller may run
    inside one), all at once and each within `timeout_s` ([Note: bounded close]); errors are
    logged, never raised over the error being reported."""
    import asyncio
    import threading

    from tiered.tiers.waiting import close_all

    async def close_them() -> None:
        try:
            await close_all(backends, timeout_s)
        except Exception as e:  # noqa: BLE001 - the set-up error is the one to report
            log.warning("after a failed set-up: %s", e)

    t = threading.Thread(target=lambda: asyncio.run(close_them()), name="tiered-setup-close", daemon=True)
    t.start()
    t.join(timeout=1.05 * timeout_s + 0.5)  # close_all bounds itself; this only covers a blocked loop


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
