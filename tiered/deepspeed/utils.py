"""``deepspeed.utils``: the safe getters and setters of a partitioned parameter's fp32 master,
gradient and Adam state, and `set_z3_leaf_modules`.

[Note: safe getters and setters]
DeepSpeed's ``safe_get_full_*`` return one parameter's whole value (every rank's piece gathered,
a collective: every rank calls it), ``safe_get_local_*`` this rank's piece as a flat tensor, and
the setters write a value back into the partitions. tiered answers them from the shard group that
holds the parameter: the fp32 master ("master"; the parameter partition itself where that is the
master), Adam's ``exp_avg`` / ``exp_avg_sq``, and the accumulated gradient (fp32, divided by
gradient_accumulation_steps and, in fp16, times the loss scale: the bytes the next step unscales;
zero after each step, as DeepSpeed's). One difference: ``safe_set_full_fp32_param`` also writes
the compute-dtype parameter, so the next forward sees the new value (DeepSpeed's copies it at the
next step). A parameter no engine manages, or a frozen one asked for optimizer state, gives None,
as DeepSpeed's. Each call reads (and a setter rewrites) the whole partitions its slice of the
group's shard touches (the group's, or its optimizer tiles'; moments decoded where the format
encodes them: [Note: safe getters over tiles and formats]): these are for inspection and surgery,
not for every step.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tiered.checkpoint.partition_io import resident, write_partition
from tiered.deepspeed.runtime.dataloader import RepeatingLoader
from tiered.deepspeed.zero import engine_of
from tiered.zero import set_leaf_modules

if TYPE_CHECKING:
    from tiered.engine import Engine

__all__ = [
    "RepeatingLoader",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
    "set_z3_leaf_modules",
]

_STATE_KEYS = ("exp_avg", "exp_avg_sq")

logger = logging.getLogger("DeepSpeed")
"""DeepSpeed's logger (``from deepspeed.utils import logger``): a standard logger named as DeepSpeed's."""


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message`, prefixed with the rank, as DeepSpeed's ``log_dist``: on the listed ranks
    (every rank with ``[-1]``), and always before the process group exists."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    wanted = ranks or []
    if rank == -1 or (wanted and wanted[0] == -1) or rank in wanted:
        logger.log(level, "[Rank %s] %s", rank, message)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any]) -> list[torch.nn.Module]:
    """DeepSpeed's name of `tiered.zero.set_leaf_modules` ([Note: leaf modules])."""
    return set_leaf_modules(model, leaf_module_classes)


def _locate(param: torch.Tensor) -> tuple[Engine, list[tuple[Any, Any]]] | None:
    """(engine, [(shard group, entry)]) of a managed parameter: one entry, or one per piece of a
    parameter planned in pieces ([Note: fused parameters in pieces] in tiered/zero/split.py)."""
    engine = engine_of([param])
    if engine is None:
        return None
    name = next(n for n, p in engine.module.named_parameters(remove_duplicate=False) if p is param)
    # a tied parameter is recorded under its first name
    first = next((n for n, p in engine.module.named_parameters() if p is param), name)
    for want in (name, first):
        found = [(g, e) for g in engine.zero.groups for e in g.entries if e.name == want]
        if found:
            return engine, sorted(found, key=lambda ge: ge[1].start)
    return None


def _tiles(engine: Engine, group: Any, kind: str) -> list[tuple[int, int, Any]] | None:
    """(start, stop, partition) of each stretch of `group`'s shard that holds `kind`, in shard
    order: one for the parameter and the gradient, one per optimizer tile for the master and
    the moments ([Note: safe getters over tiles and formats]); None for a frozen group's state."""
    if kind in ("param", "grad"):
        return [(0, group.shard_numel, group.param if kind == "param" else group.grad)]
    if not group.trainable:
        return None
    og = engine.optimizer.group(group)
    if kind == "master" and og.param_is_master:
        return [(0, group.shard_numel, group.param)]
    return [(t.start, t.stop, getattr(t.states, kind)) for t in og.tiles]


# [Note: safe getters over tiles and formats]
# A group whose optimizer state is staged is stepped in tiles, each with its own master and moment
# partitions ([Note: sub-group pipeline]), and a compressed optimizer-state format stores each
# tile's moments encoded ([Note: compressed optimizer state]): bf16 values, or int8 block codes
# whose scales belong to the tile. A read takes the tiles its slice of the shard overlaps and, for
# an encoded moment, decodes each whole tile with the format's codec, as the step does before it
# updates that tile: the values returned are exactly the fp32 moments the next step starts from.
# A write into int8 moments would have to re-encode whole blocks, rounding their other elements
# stochastically: refused by name; bf16 ones take the value rounded to bf16 (element by element).
def _codec(engine: Engine, kind: str) -> Any:
    """The codec of moment `kind` in this run's format (None for the master, param and grad)."""
    return getattr(engine.optimizer.fmt, kind) if kind in _STATE_KEYS else None


def _settle(engine: Engine) -> None:
    engine.optimizer.wait_writes()  # the last step's write-backs: their bytes are the newest


def _read_tile(engine: Engine, part: Any, kind: str, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of one tile's partition `part`, as fp32 on the host (decoded where the
    format encodes the moment: [Note: safe getters over tiles and formats])."""
    codec = _codec(engine, kind)
    with resident(engine.tm, part) as t:
        if codec is None or codec.lossless:
            return t[lo:hi].to("cpu", torch.float32, copy=True)
        raw = t.to("cpu", copy=True).reshape(-1).view(torch.uint8)
    whole = torch.empty(codec.decoded_numel(raw.numel()))
    codec.decode(raw, whole)
    return whole[lo:hi]


def _read_local(param: torch.Tensor, kind: str) -> tuple[Engine, list[tuple[Any, Any]], torch.Tensor] | None:
    """This rank's part of `kind` of the parameter, flat (its pieces' parts in order)."""
    found = _locate(param)
    if found is None:
        return None
    engine, pieces = found
    if _tiles(engine, pieces[0][0], kind) is None:
        return None
    _settle(engine)
    parts = [_local_part(engine, g, e, kind) for g, e in pieces]
    return engine, pieces, torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)


def _local_part(engine: Engine, g: Any, e: Any, kind: str) -> torch.Tensor:
    sl = g.shard_slice(e)
    if sl is None:
        return torch.empty(0, dtype=torch.float32)
    s_shard, _s_param, n = sl
    if (
        kind == "grad"
    ):  # the zero of a step is written lazily: the coordinator knows ([Note: lazy gradient zeroing])
        return engine.zero.read_grad_shard(g)[s_shard : s_shard + n].to(torch.float32)
    piece = torch.empty(n, dtype=torch.float32)
    for a, b, part in _tiles(engine, g, kind) or []:
        lo, hi = max(a, s_shard), min(b, s_shard + n)
        if hi > lo:
            piece[lo - s_shard : hi - s_shard] = _read_tile(engine, part, kind, lo - a, hi - a)
    return piece


def _full(param: torch.Tensor, kind: str) -> torch.Tensor | None:
    got = _read_local(param, kind)
    if got is None:
        return None
    engine, pieces, local = got
    shape = pieces[0][1].shape
    full = torch.zeros(math.prod(shape), dtype=torch.float32)
    at = 0
    for g, e in pieces:
        sl = g.shard_slice(e)
        if sl is not None:
            full[sl[1] : sl[1] + sl[2]] = local[at : at + sl[2]]
            at += sl[2]
    if engine.world_size > 1:
        dev = "cuda" if dist.get_backend(engine.process_group) == "nccl" else "cpu"
        t = full.to(dev)
        dist.all_reduce(t, group=engine.process_group)  # the pieces are disjoint: a sum gathers
        full = t.cpu()
    return full.reshape(shape)


def _write(param: torch.Tensor, kinds: tuple[str, ...], value: torch.Tensor, *, local: bool) -> None:
    found = _locate(param)
    if found is None:
        return
    engine, pieces = found
    name, shape = pieces[0][1].name, pieces[0][1].shape
    for kind in kinds:  # [Note: safe getters over tiles and formats]
        codec = _codec(engine, kind)
        if codec is not None and codec.block_numel > 1:
            raise ValueError(
                f"{name}: cannot write {kind}: tiered.optimizer_state_format "
                f"{engine.optimizer.fmt.name!r} stores it as block codes of {codec.block_numel} elements, "
                "and re-encoding a block would round its other elements; read it (decoded) instead, "
                "or train with tiered.optimizer_state_format 'fp32' or 'bf16' to set it"
            )
    _settle(engine)
    slices = [(g, g.shard_slice(e)) for g, e in pieces]
    flat = value.detach().reshape(-1).to("cpu", torch.float32)
    want = sum(sl[2] for _, sl in slices if sl is not None) if local else math.prod(shape)
    if flat.numel() != want:
        raise ValueError(
            f"{name}: the value has {flat.numel()} elements, the {'local piece' if local else 'parameter'} {want}"
        )
    at = 0
    for g, sl in slices:
        if sl is None:
            continue
        s_shard, s_param, n = sl
        piece = flat[at : at + n] if local else flat[s_param : s_param + n]
        at += n
        written: set[int] = set()
        for kind in kinds:
            for a, b, part in _tiles(engine, g, kind) or []:
                lo, hi = max(a, s_shard), min(b, s_shard + n)
                if hi <= lo or id(part) in written:
                    continue
                written.add(id(part))
                with resident(engine.tm, part) as t:
                    whole = t.to("cpu", copy=True)
                whole[lo - a : hi - a] = piece[lo - s_shard : hi - s_shard].to(whole.dtype)
                write_partition(engine.tm, part, whole)
    engine.zero.params_updated()


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's fp32 master, whole (a collective). See [Note: safe getters and setters]."""
    found = _locate(param)
    if found is None:
        return None
    return _full(param, "master" if found[1][0][0].trainable else "param")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    return _full(param, "grad")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """Adam's ``exp_avg`` or ``exp_avg_sq`` of the parameter, whole (a collective)."""
    return _full(param, _state_key(optim_state_key))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of the fp32 master, flat (empty where the rank holds none of it)."""
    found = _locate(param)
    if found is None:
        return None
    got = _read_local(param, "master" if found[1][0][0].trainable else "param")
    return None if got is None else got[2]


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    got = _read_local(param, "grad")
    return None if got is None else got[2]


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    got = _read_local(param, _state_key(optim_state_key))
    return None if got is None else got[2]


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write the whole fp32 value (every rank passes it) into the master and the parameter."""
    _write(param, ("master", "param"), value, local=False)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    _write(param, ("master", "param"), value, local=True)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _write(param, (_state_key(optim_state_key),), value, local=False)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _write(param, (_state_key(optim_state_key),), value, local=True)


def _state_key(key: str) -> str:
    if key not in _STATE_KEYS:
        raise KeyError(f"optim_state_key {key!r}: tiered's Adam keeps {', '.join(_STATE_KEYS)}")
    return key
