"""Keeping the host heap from growing past the tier budgets.

[Note: host allocations and glibc's heap]
The host tiers' buffers, staging copies, gradients and Adam temporaries are tensors of 1-200 MB
allocated and freed all through a step, from several threads. glibc's malloc serves a request
above its mmap threshold with a mapping of its own, returned to the kernel on free, and smaller
ones from heaps (one per thread arena) that hand memory back only from their top. The threshold
is dynamic: each freed mapped chunk raises it to that chunk's size, up to 32 MiB, so after the
first step every partition under 32 MiB is carved from the heaps, where freed partitions of one
size leave holes other sizes do not fit. The process then holds far more than the tiers' budgets
say: measured with `benchmarks/big_model.py` at 205M parameters (budgets 0.83 GiB), peak RSS in
training 1.81 GiB with glibc's default and 1.20 GiB with the threshold fixed at 1 MiB; the export
2.15 vs 0.97 GiB. At 2B parameters the default overshot the budgets + 2 GiB target
(benchmarks/RESULTS.md, "Big model").

So `initialize` fixes glibc's threshold (``mallopt(M_MMAP_THRESHOLD, n)``, which also turns the
dynamic adjustment off) at ``tiered.host_mmap_threshold`` (default 1 MiB): every allocation above
it is a mapping of its own, freed whole. What it costs: a large allocation is an ``mmap`` and its
first touch page faults, which the pools of the host tiers avoid for the buffers that recur
([Note: size-class buffer pool]). It is process-wide, so it is done once, logged, and never where
the program chose for itself: not when ``MALLOC_MMAP_THRESHOLD_`` is in the environment (glibc's
own knob), not when the key is ``false``, and not where the C library is not glibc (musl, macOS:
nothing to do).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (malloc.h)."""
ENV = "MALLOC_MMAP_THRESHOLD_"

_lock = threading.Lock()
_applied: int | None = None


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def fix_mmap_threshold(threshold: int | None) -> str:
    """Apply [Note: host allocations and glibc's heap] for `threshold` bytes (None: leave malloc
    alone); what was done, in words."""
    global _applied
    if threshold is None:
        return "left alone (tiered.host_mmap_threshold is false)"
    if os.environ.get(ENV):
        return f"left alone ({ENV} is set)"
    with _lock:
        if _applied == threshold:
            return f"already {threshold} bytes"
        libc = _glibc()
        if libc is None:
            return "left alone (the C library is not glibc)"
        if libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold)) != 1:
            log.warning(
                "tiered: glibc refused mallopt(M_MMAP_THRESHOLD, %d); the host heap may outgrow the tier budgets",
                threshold,
            )
            return "refused by glibc"
        _applied = threshold
    log.info(
        "tiered: glibc's mmap threshold fixed at %d bytes ([Note: host allocations and glibc's heap])",
        threshold,
    )
    return f"fixed at {threshold} bytes"
