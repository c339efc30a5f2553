"""`engine.gathered_parameters`: full parameters outside forward, read or modified.

[Note: gathered parameters]
DeepSpeed's ``GatheredParameters``: inside the context the parameters' ``.data`` are their full
values (their groups gathered, a collective with several ranks). With ``modify=True`` the values
at exit are written back to every copy: rank 0's values are broadcast first (DeepSpeed's
``modifier_rank=0``), then each rank writes its shard into the parameter partition and, where the
optimizer keeps a separate fp32 master, into the master too (upcast from the compute dtype, as
DeepSpeed does), so the next step starts from them. Adam's moments are left as they are. An
exception inside the context writes nothing back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from tiered.checkpoint.engine_state import tiles_of
from tiered.checkpoint.partition_io import write_partition


def parameters_of(params_or_module: Any) -> list[torch.nn.Parameter]:
    if isinstance(params_or_module, torch.nn.Module):
        return list(params_or_module.parameters())
    if isinstance(params_or_module, torch.nn.Parameter):
        return [params_or_module]
    if isinstance(params_or_module, Iterable):
        return list(params_or_module)
    raise TypeError(
        f"gathered_parameters: expected a module, a parameter or parameters, got "
        f"{type(params_or_module).__name__}"
    )


@contextmanager
def gathered_parameters(
    zero: Any,
    tm: Any,
    optimizer_parts: dict[str, dict[str, Any]],
    params: list[torch.nn.Parameter],
    *,
    modify: bool,
    world_size: int,
    process_group: Any = None,
    gather: Callable[[list[torch.nn.Parameter]], AbstractContextManager[list[tuple[Any, torch.Tensor]]]],
    pull: Callable[[list[Any]], None] = lambda groups: None,
) -> Iterator[None]:
    """See [Note: gathered parameters]. `gather(params)` holds the groups of `params` gathered
    (tiered.zero.full_params.gathered over `zero`) and yields (group, full buffer) per group;
    `pull(groups)` brings values modified outside the full buffers into them (a parameter in
    pieces, modified in its whole buffer)."""
    shards: list[tuple[Any, torch.Tensor]] = []
    with gather(params) as groups:
        yield
        if modify:
            pull([g for g, _ in groups])
            for g, full in groups:
                if world_size > 1:
                    import torch.distributed as dist

                    dist.broadcast(full, src=0, group=process_group)
                shard = full[g.shard_offset : g.shard_offset + g.shard_numel] if world_size > 1 else full
                shards.append((g, shard.detach().to("cpu", copy=True)))
    for g, shard in shards:
        write_partition(tm, g.param, shard)
        master = optimizer_parts.get(g.name, {}).get("master")
        if master is not None and master is not g.param:
            fp32 = shard.to(torch.float32)
            for start, tile in tiles_of(master):  # a group stepped in tiles: one partition each
                write_partition(tm, tile, fp32[start : start + tile.numel])
    if shards:
        zero.params_updated()
