"""Flat shard groups: the unit ZeRO-3 partitions, gathers, reduces and steps.

The interface between the ZeRO-3 scheduler (tiered.zero) and the offloaded optimizer
(tiered.optim), below both so that neither imports the other. `tiered.zero.ZeroParameters`
(tiered/zero/coordinator.py) builds the groups, owns their partitions and installs the module
hooks:

    zp = ZeroParameters(model, tm, cfg, *, param_tier, grad_tier, compute_dtype, process_group=None)
    zp.groups                          # list[ShardGroup], execution order at init
    zp.initial_fp32_shard(group)       # fp32 master values of this rank's shard, once per group
    zp.finish_backward(summarize=True) # -> GradSummary(found_inf, sq_norm_local) after loss.backward()
    zp.zero_grads()                    # after a step or a skipped step
    zp.params_updated()                # after the optimizer wrote new parameters (prefetches the next pass)
    zp.on_group_grads_complete(cb)     # cb(group) once a group's gradients of this backward are flushed
    zp.seal_for_step(group)            # overlapped step: a later gather in this backward raises
    zp.read_grad_shard(group)          # CPU copy of the accumulated fp32 gradient shard
    zp.gather_full_state_dict(dtype=None), zp.stats(), zp.remove_hooks()

The forward needs no begin/end calls: the root module's hooks delimit a pass.

[Note: flat shard groups]
Parameters are grouped into flat buffers in module execution order (module registration order
at init; the recorded trace later gives the real order for prefetching). A group is one module's
direct parameters merged with its neighbours' up to ``sub_group_size`` elements, never split
inside a parameter, so one group is also one optimizer sub-group. The full (unsharded) buffer is
padded to a multiple of ``world_size * alignment`` elements so every rank's shard has the same
size and starts aligned; rank r owns elements [r * shard_numel, (r + 1) * shard_numel). A tied
(shared) parameter belongs to the group of the first module that owns it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiered.tiers import Partition


@dataclass(frozen=True)
class ParamEntry:
    """Where one parameter (or one piece of it) lives inside its group's FULL (unsharded) flat buffer."""

    name: str
    offset: int
    numel: int
    """Elements of the entry: the parameter's, or its piece's."""
    shape: tuple[int, ...]
    """The parameter's shape (a piece's too)."""
    start: int = 0
    """The entry's first element within its parameter: 0, or where its piece begins (a fused expert
    tensor planned in pieces of whole experts, [Note: fused parameters in pieces] in tiered/zero/split.py)."""

    @property
    def is_piece(self) -> bool:
        """The entry holds part of its parameter (the others are in other groups)."""
        return self.start != 0 or self.numel != math.prod(self.shape)


@dataclass(frozen=True)
class ShardGroup:
    """One partition = one optimizer sub-group. See [Note: flat shard groups]."""

    index: int
    """Position in (initial) execution order."""
    name: str
    """e.g. "g0003": the prefix of this group's partition names in the TierManager."""
    entries: tuple[ParamEntry, ...]
    full_numel: int
    """Padded to a multiple of world_size * alignment."""
    shard_numel: int
    """full_numel // world_size."""
    shard_offset: int
    """rank * shard_numel."""
    param: Partition
    """This rank's shard of the compute-dtype parameters; home = the parameter tier."""
    grad: Partition | None
    """This rank's shard of the fp32 gradient; home = the gradient tier. None for a frozen
    group (see [Note: frozen parameters] in tiered/zero/plan.py)."""
    persistent: bool = False
    """Small parameters kept resident in "gpu" for the whole run (stage3 persistence)."""

    @property
    def trainable(self) -> bool:
        """The optimizer steps this group (its parameters require grad)."""
        return self.grad is not None

    @property
    def numel(self) -> int:
        """Real (unpadded) parameter elements in the group."""
        return sum(e.numel for e in self.entries)

    def shard_slice(self, entry: ParamEntry) -> tuple[int, int, int] | None:
        """The part of `entry` that lies in this rank's shard, as (start_in_shard,
        start_in_param, length), or None if the shard holds none of it. start_in_param counts
        from the parameter's first element (a piece's `start` included)."""
        lo = max(entry.offset, self.shard_offset)
        hi = min(entry.offset + entry.numel, self.shard_offset + self.shard_numel)
        if hi <= lo:
            return None
        return lo - self.shard_offset, entry.start + lo - entry.offset, hi - lo


def padded_numel(numel: int, world_size: int, alignment: int) -> int:
    """Round `numel` up so it splits into `world_size` equal shards of `alignment` multiples."""
    unit = world_size * alignment
    return max(unit, -(-numel // unit) * unit)


def cpu_stepped(shard_numels: Sequence[int], ratio: float) -> frozenset[int]:
    """Which of the trainable groups (their shard sizes, in execution order) the CPU kernel steps
    where the optimizer is offloaded: the ``round(ratio x n)`` largest, ties by execution order
    ([Note: twin-flow ratio] in tiered/optim/placement.py); the others step on the GPU. Here,
    below the ZeRO scheduler and the optimizer, because both need it: the scheduler homes the
    GPU-stepped groups' gradients before the optimizer exists ([Note: a GPU-stepped gradient
    stays on the GPU] in tiered/optim/placement.py)."""
    n = len(shard_numels)
    n_cpu = n if ratio >= 1.0 else int(round(ratio * n))
    by_size = sorted(range(n), key=lambda i: (-shard_numels[i], i))
    return frozenset(by_size[:n_cpu])


def grad_homes(
    shard_numels: Sequence[int],
    trainable: Sequence[bool],
    grad_tier: str,
    ratio: float,
    gpu_stepped_tier: str | None = None,
) -> list[str | None]:
    """Per group, the home of its fp32 gradient: None for a frozen group, `gpu_stepped_tier`
    (default `grad_tier`) for one the GPU kernel steps, else `grad_tier` (``tiered.grad_tier``,
    "cpu" by default with the optimizer offloaded). [Note: a GPU-stepped gradient stays on the
    GPU] is in tiered/optim/placement.py, which chooses `gpu_stepped_tier`."""
    trainable_numels = [n for n, t in zip(shard_numels, trainable, strict=True) if t]
    on_cpu = cpu_stepped(trainable_numels, ratio)
    out: list[str | None] = []
    j = 0
    for t in trainable:
        if not t:
            out.append(None)
            continue
        out.append(grad_tier if j in on_cpu else (gpu_stepped_tier or grad_tier))
        j += 1
    return out


def group_name(index: int) -> str:
    """The partition-name prefix of group `index` ("g0003")."""
    return f"g{index:04d}"
