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
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "new_group",
    "reduce",
    "reduce_scatter_tensor",
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
