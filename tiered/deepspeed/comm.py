"""``deepspeed.comm``: DeepSpeed's collective API over torch.distributed, and `init_distributed`.

[Note: one process without a launcher]
DeepSpeed's ``init_distributed`` (called by its initialize) always leaves a default process group
behind: under a launcher from its environment, else from an MPI discovery that makes a single
process a world of one and writes RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT into
``os.environ``. Ported scripts rely on both: on the group (``deepspeed.comm.get_rank()``,
``torch.distributed.barrier()`` after initialize) and on the variables (``int(os.environ
["LOCAL_RANK"])``, a Hugging Face helper reading WORLD_SIZE). So tiered does the same for
``python train.py`` (with or without the ``--local_rank`` a launcher passes): under torchrun
(WORLD_SIZE > 1) from its environment ([Note: process group from torchrun]); in one process the
missing variables get DeepSpeed's single-process values (RANK 0, WORLD_SIZE 1, LOCAL_RANK 0,
MASTER_ADDR 127.0.0.1) and the group a world of one, NCCL with CUDA else gloo. Without a
MASTER_PORT the store listens on a port the kernel picks (port 0), which then becomes MASTER_PORT:
no guessed free port that another process could take first (DeepSpeed's fixed 29500 collides with
any other run on the machine). Variables already set are kept, and with all of them set the group
comes from env://, as DeepSpeed's. An existing group is used as it is.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tiered.engine.distributed import ensure_process_group, env_world_size

log = logging.getLogger(__name__)

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's: leave a default process group behind ([Note: one process without a
    launcher]). `dist_backend` overrides NCCL-with-CUDA-else-gloo; DeepSpeed's MPI discovery,
    `init_method` and an explicit `rank`/`world_size` are not supported (torchrun's environment or
    your own ``init_process_group`` instead)."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if init_method is not None or rank != -1 or world_size != -1:
        raise NotImplementedError(
            "tiered.deepspeed.init_distributed(init_method=/rank=/world_size=): launch with torchrun, or call "
            "torch.distributed.init_process_group yourself before initialize"
        )
    if env_world_size() > 1:
        ensure_process_group(dist_backend)  # [Note: process group from torchrun]
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _one_process_group(backend, distributed_port)
    if verbose:
        log.info(
            "no launcher: initialised a one-process %s group (MASTER_PORT %s), as DeepSpeed's "
            "init_distributed does",
            backend,
            os.environ["MASTER_PORT"],
        )


def _one_process_group(backend: str, port: int | None) -> None:
    """A world of one with DeepSpeed's environment ([Note: one process without a launcher])."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if port is not None:
        os.environ.setdefault("MASTER_PORT", str(port))
    if os.environ.get("MASTER_PORT"):
        dist.init_process_group(backend, init_method="env://")
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, 1, is_master=True, wait_for_workers=False)
    os.environ["MASTER_PORT"] = str(store.port)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=1)


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """torchrun's LOCAL_RANK (0 for one process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return dist.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    return int(dist.recv(tensor, src, group=group, tag=tag))


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def get_backend(group: Any = None) -> str:
    return str(dist.get_backend(group))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    return dist.group.WORLD


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of `group`'s members. ``group=None`` gives [], DeepSpeed's answer (it
    asks torch for each member's global rank, which torch refuses for None)."""
    if group is None:
        return []
    return list(dist.get_process_group_ranks(group))


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's communication-logger summary: tiered keeps no such log (its per-tier traffic is
    ``engine.stats()``); logged at INFO so the call is not silent."""
    log.info(
        "deepspeed.comm.log_summary(): tiered records no communication log; engine.stats() has the traffic"
    )
