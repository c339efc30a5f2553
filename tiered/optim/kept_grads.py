"""The gradients kept in "cpu" for the overlapped step to consume, and backward's backpressure on
them (lifetime: the engine's; one step's bookkeeping at a time).

[Note: backward waits instead of parking]
With the gradients consumed from memory ([Note: gradient consumed from memory] in
tiered/optim/group.py) each flushed gradient stays in "cpu", dirty, until its step discards it.
When backward runs ahead of the stepper (an I/O-bound step) the kept gradients fill the cpu
tier, and a request that needs room there (the next flush, or the stepper's own reads) made the
tier manager write some home: "parking", a write and a read of 4 B per element that the step
exists to avoid, added to the drive that already bounds the step (on the 2B replica 85 of 534
group steps, 1.6 GB each way per step). Holding backward back instead costs nothing the drive
was not already costing: the stepper has work queued the whole time. So:

* admission: before a flush stages a gradient it will keep, `KeptGrads.admit` waits until it
  fits without writing anything home: the kept gradients plus this one within the tier's budget
  less its home partitions, the pipeline's own staging bound (`pipeline_bytes`: what the
  stepper may reserve at once, so its reads never need a kept gradient's room either) and the
  new parameters ``offload_param.max_in_cpu`` keeps there ([Note: max_in_cpu]: taking their
  room wrote every one of them home and read it back each step, 2 GB each way on the 1/20
  headline replica, bytes the plan's formula does not have), and the
  clean room of the tier (free budget plus unpinned clean copies, `TierManager.clean_room_bytes`)
  enough for this one. It waits only while some kept gradient has been handed to the stepper and
  not stepped yet, and the stepper runs: those steps will free room, so the wait ends; with none
  pending (a single group, a group whose step waits for the ranks' verdict, the step failed) it
  proceeds as before, so it can never deadlock. The wait is bounded by ``tiered.timeout_s`` and
  raises naming what it waited for. The bound double counts a little (a gradient the stepper
  holds is in both terms): backward then waits slightly earlier than it must, never parks.
* victims: should the manager still need room (the budget too small for the bound), the cpu
  tier's policy (`KeptLastPolicy`) takes clean copies first, then other dirty ones least
  recently used first, and kept gradients last, the most recently flushed first: its step is the
  furthest away, and the one the stepper takes next is never chosen while another will do (the
  default least-recently-used order chose exactly that one).

Exactness is untouched: the same fp32 values are stepped; only when they are written is changed.
`stats()` gives the group steps whose kept gradient was parked anyway (and the bytes: a write
and a read each) and backward's waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from tiered.errors import TierTimeoutError
from tiered.tiers import CopyState

if TYPE_CHECKING:
    from tiered.tiers import Partition, TierManager

POLL_S = 0.01
"""How often an admission wait re-checks the tier: room also frees when a discard or a state's
write-back lands on the manager's loop, which signals no condition of ours."""


class KeptGrads:
    """The kept gradients of the current overlapped step. See [Note: backward waits instead of parking]."""

    def __init__(self, tm: TierManager, tier: str, staging_bytes: int, timeout_s: float) -> None:
        """`staging_bytes`: what the kept gradients must leave free in `tier` besides its home
        partitions: the pipeline's own staging bound (`pipeline_bytes`) and the parameters kept
        there by max_in_cpu."""
        self.tm = tm
        self.tier = tier
        self.timeout_s = timeout_s
        budget = tm.budget_bytes(tier)
        home = sum(p.nbytes for p in tm.partitions() if p.home == tier)
        self.allowance: int | None = None if budget is None else budget - home - staging_bytes
        """Bytes of kept gradients the tier holds while the pipeline has its bound of room."""
        self._cv = threading.Condition()
        self._seq = 0
        self._kept: dict[str, int] = {}  # name -> flush sequence: kept, not yet stepped
        self._kept_bytes = 0
        self._queued: set[str] = set()  # handed to the stepper, not yet stepped
        self._stepping = False
        self.order: MappingProxyType[str, int] = MappingProxyType({})
        """A snapshot of the kept gradients' flush order for the policy, replaced on each change
        (the policy runs on the manager's loop and must not take our lock: `admit` holds it
        around no manager call, but a snapshot needs no lock at all)."""
        self.parked_steps = 0
        self.parked_bytes = 0
        self.waits = 0
        self.wait_s = 0.0
        tm.set_eviction_policy(tier, KeptLastPolicy(self))

    # ---- the stepper's side ----------------------------------------------------------------
    def begin_step(self) -> None:
        with self._cv:
            self._kept.clear()  # a gradient kept last step whose group was never stepped
            self._kept_bytes = 0
            self._queued.clear()
            self._stepping = True
            self.order = MappingProxyType({})

    def end_step(self) -> None:
        """The stepper stopped (done or failed): nothing it was handed will free room now."""
        with self._cv:
            self._stepping = False
            self._queued.clear()
            self._cv.notify_all()

    def queued(self, part: Partition) -> None:
        """`part`'s group was handed to the stepper (before it can be stepped)."""
        with self._cv:
            if part.name in self._kept:
                self._queued.add(part.name)

    def stepped(self, part: Partition, *, from_memory: bool) -> None:
        """`part`'s step is over: consumed from memory, or (`from_memory` False) read from home."""
        with self._cv:
            if self._kept.pop(part.name, None) is None:
                return
            self._kept_bytes -= part.nbytes
            self._queued.discard(part.name)
            if not from_memory:
                self.parked_steps += 1
                self.parked_bytes += 2 * part.nbytes
            self.order = MappingProxyType(dict(self._kept))
            self._cv.notify_all()

    # ---- backward's side (the `GradKeeper` of tiered/zero/grad_home.py) --------------------
    def admit(self, part: Partition) -> None:
        """Block until `part` can be staged in the tier and kept there without writing any kept
        gradient home, or no kept gradient is pending with a running stepper; TierTimeoutError
        after ``tiered.timeout_s``."""
        t0 = time.perf_counter()
        waited = False
        with self._cv:
            while self._queued and self._stepping and self.allowance is not None:
                if self._kept_bytes + part.nbytes <= self.allowance:
                    self._cv.release()  # never around a manager call: see `order`
                    try:
                        room = self.tm.clean_room_bytes(self.tier)
                    finally:
                        self._cv.acquire()
                    if room is None or room >= part.nbytes:
                        break
                left = t0 + self.timeout_s - time.perf_counter()
                if left <= 0:
                    raise TierTimeoutError(
                        f"backward's flush of gradient {part.name!r} ({part.nbytes} B) waited "
                        f"{self.timeout_s:.0f} s (tiered.timeout_s) for the overlapped step to "
                        f"consume one of the {len(self._queued)} kept gradients handed to it "
                        f"({self._kept_bytes} B kept in tier {self.tier!r}, allowance "
                        f"{self.allowance} B): is the optimizer step stuck on its reads or writes?"
                    )
                waited = True
                self._cv.wait(min(left, POLL_S))
        if waited:
            self.waits += 1
            self.wait_s += time.perf_counter() - t0

    def kept(self, part: Partition) -> None:
        """`part` was flushed and left in the tier, dirty, for its step."""
        with self._cv:
            if part.name not in self._kept:
                self._kept_bytes += part.nbytes
            self._kept[part.name] = self._seq
            self._seq += 1
            self.order = MappingProxyType(dict(self._kept))

    def stats(self) -> dict[str, float]:
        return {
            "parked_group_steps": self.parked_steps,
            "parked_bytes": self.parked_bytes,
            "backward_waits": self.waits,
            "backward_wait_s": self.wait_s,
        }


class KeptLastPolicy:
    """The cpu tier's eviction order while gradients are kept: clean copies first (free), then
    other dirty ones, least recently used first, then the kept gradients, the most recently
    flushed first. See [Note: backward waits instead of parking]."""

    def __init__(self, kept: KeptGrads) -> None:
        self.kept = kept

    def choose(self, tier: str, candidates: Sequence[Partition], need_bytes: int) -> Sequence[Partition]:
        order = self.kept.order

        def key(p: Partition) -> tuple[int, int, int]:
            seq = order.get(p.name)
            if seq is not None:
                return (2, -seq, 0)
            return (int(p.state(tier) is CopyState.DIRTY), 0, p.last_use(tier))

        return sorted(candidates, key=key)
