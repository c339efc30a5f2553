"""The few collectives ZeRO-3 needs, over torch.distributed, with gloo fallbacks.

[Note: gloo collectives]
NCCL has ``all_gather_into_tensor`` and ``reduce_scatter_tensor``. Gloo (the CPU backend used in
tests and on CPU clusters) lacks ``reduce_scatter_tensor``, so there the gradient is
``all_reduce``d and each rank keeps its slice: the same result at world_size times the traffic,
which is acceptable on the CPU path and keeps one code path for correctness. Gradients are
averaged over ranks (divided by world size), as data-parallel training and DeepSpeed do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def world(process_group: ProcessGroup | None) -> tuple[int, int]:
    """(world_size, rank) of `process_group` (the default group if None); (1, 0) without dist."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(process_group), dist.get_rank(process_group)


def _is_gloo(process_group: ProcessGroup | None) -> bool:
    return str(dist.get_backend(process_group)).lower() == "gloo"


def all_gather_into(full: torch.Tensor, shard: torch.Tensor, process_group: ProcessGroup | None) -> None:
    """Fill `full` with every rank's `shard`, in rank order."""
    if _is_gloo(process_group):
        chunks = list(full.chunk(dist.get_world_size(process_group)))
        dist.all_gather(chunks, shard.contiguous(), group=process_group)
        return
    dist.all_gather_into_tensor(full, shard, group=process_group)


def reduce_scatter_mean(full: torch.Tensor, process_group: ProcessGroup | None) -> torch.Tensor:
    """This rank's shard of the rank-average of `full` (fp32). See [Note: gloo collectives]."""
    ws = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    n = full.numel() // ws
    if _is_gloo(process_group):
        dist.all_reduce(full, group=process_group)
        out = full[rank * n : (rank + 1) * n]
    else:
        out = torch.empty(n, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_tensor(out, full, group=process_group)
    return out.div_(ws)


def all_reduce_sum(x: float, process_group: ProcessGroup | None) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=process_group)
    return float(t.item())


def all_reduce_max_(t: torch.Tensor, process_group: ProcessGroup | None) -> None:
    """Element-wise MAX of a small CPU tensor over the ranks, in place (NCCL: via the GPU)."""
    if _is_gloo(process_group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
        return
    dev = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(dev, op=dist.ReduceOp.MAX, group=process_group)
    t.copy_(dev.cpu())


def any_rank(flag: bool, world_size: int, process_group: ProcessGroup | None) -> bool:
    """Whether `flag` holds on some rank (one small MAX all-reduce; `flag` itself on one rank)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    all_reduce_max_(t, process_group)
    return bool(t.item() > 0)
