"""What one engine is made of: `EngineParts`, built whole by `tiered.engine.build` before the
`Engine` exists and never changed after, and `EngineHooks`, what a caller outside the engine adds
to its steps, checkpoints and close (tiered.deepspeed's client optimizer and scheduler); and what
the memory model promised of the parts next to what the run measured (`Engine.stats()`'s host
peak, [Note: one memory model], and bytes moved per step, [Note: bytes per step])."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, TypeVar, overload

if TYPE_CHECKING:
    import torch

    from tiered.config.schema import TieredConfig
    from tiered.optim.offload import OffloadedAdam
    from tiered.optim.schedulers import LRSchedule
    from tiered.planning.homes import Placement
    from tiered.planning.needs import TierNeed
    from tiered.planning.residency import Residency
    from tiered.tiers import TierManager
    from tiered.zero import ZeroParameters


class EngineHooks(Protocol):
    """Called by the engine for a caller that drives part of the training from outside it: the
    lr (a client scheduler), state the checkpoint carries (its position), and something to undo
    at close. `tiered.deepspeed.client.ClientSide` is the one implementation."""

    def after_applied_step(self, next_lrs: list[float]) -> None:
        """An optimizer step was applied; `next_lrs` is the lr of each param group for the next."""

    def training_state(self) -> dict[str, Any]:
        """Saved in the checkpoint's training state, beside the engine's counters."""
        ...

    def apply_training_state(self, state: dict[str, Any], *, lr_scheduler: bool) -> None:
        """A checkpoint's training state is loaded (`lr_scheduler` False: keep the schedule's)."""

    def closed(self) -> None:
        """The engine closed."""


@dataclass(frozen=True)
class EngineParts:
    """Everything an `Engine` runs over, each piece owned by the object named here (the engine
    owns only its per-step state, `tiered.engine.step_state`). Built by
    `tiered.engine.build.build_parts`; the engine closes the tier manager, the ZeRO-3 hooks and
    the optimizer."""

    module: torch.nn.Module
    config: TieredConfig
    tm: TierManager
    zero: ZeroParameters
    optimizer: OffloadedAdam
    placement: Placement
    process_group: Any
    world_size: int
    rank: int
    scheduler: LRSchedule
    """The base lr of each optimizer step, by the number of steps taken ([Note: scheduler step
    indexing]): a client's lr source, else the config's scheduler section, else the constant lr."""
    config_schedule: bool
    """`scheduler` is the config's scheduler section (it then moves with Adam's step count:
    [Note: checkpoint keywords])."""
    lr_scales: tuple[float, ...]
    """Each param group's lr as a multiple of the base lr (one group: ``(1.0,)``)."""
    capacity: dict[str, TierNeed]
    """[Note: capacity check before training]'s need per tier."""
    host_memory: Mapping[str, Any]
    """`tiered.planning.needs.HostExtra`: the host bytes beyond the tiers the plan counts."""
    traffic_floor: dict[str, int]
    """[Note: bytes per step]'s floor per link for this run (tiered/planning/traffic.py)."""
    tier_memory: dict[str, str]
    """What each tier takes its bytes from ("device", "host" or "disk"), for the stats."""
    residency: Residency
    """What the faster tiers keep across steps ([Note: residency] in tiered/planning/residency.py)."""
    tokenizer_source: str | None = None
    """The folder the weights came from (from_pretrained, initialize(weights=...)): the tokenizer
    files `save_pretrained` copies by default."""
    hooks: EngineHooks | None = None


def host_memory_stats(parts: EngineParts) -> dict[str, Any]:
    """The host peak the memory model promises for this run (the host tiers' need, the process
    baseline, the transients outside the tiers, the backends' buffers, the imports beyond the
    baseline), next to the process's peak RSS so far (``ru_maxrss``)."""
    import resource

    extra = parts.host_memory
    tiers = sum(int(d["total"]) for t, d in parts.capacity.items() if parts.tier_memory.get(t) == "host")
    # the copies the host tiers keep across steps, inside their budgets ([Note: residency])
    tiers += sum(parts.residency.bytes_in(t) for t, m in parts.tier_memory.items() if m == "host")
    planned = tiers + int(extra.get("baseline", 0)) + int(extra.get("outside_tiers", 0))
    planned += sum(extra.get("backends", {}).values()) + int(extra.get("imports", 0))
    planned += int(extra.get("live", 0))  # the live budget's parameters where "gpu" is host memory
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {**extra, "tiers": tiers, "planned_peak_bytes": planned, "peak_rss_bytes": rss_kib * 1024}


def bytes_per_step_stats(parts: EngineParts, steps: int) -> dict[str, Any]:
    """The floor of [Note: bytes per step] next to what the tier manager moved per step so far
    (every link's bytes since initialize, over the `steps` optimizer steps taken; the first step
    includes the moves of initialize's writes and the first gather)."""
    from tiered.planning.traffic import measured_per_step

    links = parts.tm.stats().get("links", {})
    return {
        "formula": dict(parts.traffic_floor),
        "measured": measured_per_step(links, parts.tier_memory, steps) if steps else None,
        "steps": steps,
    }


T = TypeVar("T")


class Part(Generic[T]):
    """An engine attribute that is one of its `EngineParts`, by the same name: read-only, since
    the parts are fixed when the engine is built (``engine.zero`` is ``engine.parts.zero``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Part[T]: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object, owner: type) -> Part[T] | T:
        if obj is None:
            return self
        value: T = getattr(obj.parts, self._name)  # type: ignore[attr-defined]
        return value

    def __set__(self, obj: object, value: T) -> NoReturn:
        raise AttributeError(f"{self._name} is one of the engine's parts, fixed when it was built")
