"""The optimizer's write-backs in flight, across steps (lifetime: the optimizer's): one FIFO
writer thread finishes updated tiles (mark dirty, unpin, evict: each a round trip to the tier
manager's loop, which would otherwise stall the kernel of the next tile), and the futures of
those moves wait here until a step's window, the next step or a flush retires them.

[Note: write-back after the step]
The step returns with the last groups' write-backs still in flight. That is safe because the
TierManager serialises moves of one partition: a fetch of a parameter or state whose copy is
being evicted waits for the write-back and then reads the new bytes from home. The next step,
``wait_writes``, ``Engine.flush`` and ``Engine.close`` wait for them (and re-raise their errors).

[Note: a failed write-back is retried by flush]
A write-back that fails (ENOSPC on a full disk, an I/O error after its retries) loses nothing: the
tier manager marks the home copy valid only once a write completed, so the updated copy stays,
dirty, in the compute tier. The error must not cut a step in half either, so one met inside a
step (the ``buffer_count`` back-pressure) is kept and the step's other groups still update;
``wait_writes`` waits for every write in flight and raises the first error (the number of others
is logged). `Engine.step` calls it before it counts anything, so the step that raises it has done
nothing yet: once space is freed, ``engine.flush()`` writes the dirty copies home and the same
``engine.step()`` goes on, ending bit for bit where an undisturbed run does.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiered.tiers import TierFuture

log = logging.getLogger(__name__)


class WriteBacks:
    """The FIFO of issued write-backs. See [Note: write-back after the step]."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._pending: deque[Future[list[TierFuture[None]]]] = deque()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-opt-write")
        self._errors: list[Exception] = []
        """Write-backs that failed inside a step, raised by the next `wait`."""

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, finish: Callable[[], list[TierFuture[None]]]) -> None:
        """Run `finish` (which issues a tile's moves and returns their futures) on the writer."""
        self._pending.append(self._writer.submit(finish))

    def oldest_done(self) -> bool:
        """The oldest entry's moves are issued and all finished (retiring it will not wait)."""
        return (
            bool(self._pending)
            and self._pending[0].done()
            and all(f.done() for f in self._pending[0].result())
        )

    def all_issued(self) -> None:
        """Wait until every entry's moves are issued (claimed by the manager), not finished: the
        next forward can pin a partition again only after its evict was claimed."""
        for cf in self._pending:
            cf.result(timeout=self._timeout_s)

    def _retire_oldest(self) -> float:
        cf = self._pending.popleft()  # first: whatever fails below, wait's loop ends
        t0 = time.perf_counter()
        first: BaseException | None = None
        for f in cf.result(timeout=self._timeout_s):
            try:  # every write of the tile ends before its error is raised: none is left behind
                f.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others
                first = first or e
        if first is not None:
            raise first
        return time.perf_counter() - t0

    def retire_in_step(self) -> float:
        """Retire the oldest inside a step, whose error waits for `wait`: the step's other tiles
        still update ([Note: a failed write-back is retried by flush])."""
        try:
            return self._retire_oldest()
        except Exception as e:  # noqa: BLE001 - raised by the next wait
            self._errors.append(e)
            return 0.0

    def wait(self) -> float:
        """Block until every write-back issued has finished; returns seconds waited. A failed one
        raises, once, after all the others ended: see [Note: a failed write-back is retried by
        flush]."""
        waited = 0.0
        errors, self._errors = self._errors, []
        while self._pending:
            try:
                waited += self._retire_oldest()
            except Exception as e:  # noqa: BLE001 - the first is raised below
                errors.append(e)
        if errors:
            if len(errors) > 1:
                log.error(
                    "%d more optimizer write-backs failed as well (the first is raised)", len(errors) - 1
                )
            raise errors[0]
        return waited

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
