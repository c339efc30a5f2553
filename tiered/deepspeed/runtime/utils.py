"""``deepspeed.runtime.utils``: `see_memory_usage`, the memory report DeepSpeed scripts print."""

from __future__ import annotations

import gc
import os

import torch.distributed as dist

from tiered.deepspeed.accelerator import get_accelerator

__all__ = ["see_memory_usage"]

_GB = 1024**3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print `message` and the accelerator's allocated/reserved memory (current and peak, GB) and
    the host's, on rank 0, then reset the peaks, as DeepSpeed's; nothing unless `force`."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    acc = get_accelerator()
    print(message)
    print(
        f"MA {round(acc.memory_allocated() / _GB, 2)} GB         Max_MA {round(acc.max_memory_allocated() / _GB, 2)} GB "
        f"        CA {round(acc.memory_reserved() / _GB, 2)} GB         Max_CA {round(acc.max_memory_reserved() / _GB)} GB "
    )
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    used = total - page * os.sysconf("SC_AVPHYS_PAGES")
    print(f"CPU Virtual Memory:  used = {round(used / _GB, 2)} GB, percent = {round(100 * used / total, 1)}%")
    acc.reset_peak_memory_stats()
