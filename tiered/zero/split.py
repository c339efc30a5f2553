"""Fused expert parameters planned in pieces: where each piece is, and the one buffer the
parameter is put together in while its pieces are gathered.

[Note: fused parameters in pieces]
transformers 5 holds an MoE layer's experts fused: ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I], one parameter each (Qwen3-30B-A3B's ``gate_up_proj``: 0.4B
elements, 0.8 GB in bf16). Kept whole, such a parameter is one group: its partitions, its NVMe
reads and writes, its gradient and the optimizer's staging of it are each one buffer of the
whole tensor (DeepSpeed's ZeRO-3 gathers it whole through a parameter buffer it does not fit).
So the group planner ([Note: group planning] in tiered/zero/plan.py) plans a fused expert tensor
larger than the group cap (``sub_group_size``, or a leaf's cap) as consecutive pieces of whole
experts, each at most the cap (one expert at least): each piece is an entry (`ParamEntry.start`
says where it begins in the parameter) of its own group, and everything a group does (its
partitions, moves, gradient flush, optimizer step, checkpoint tensors, the streamed load of its
slice of the files) is bounded by the cap, never by the fused tensor.

The module's forward still reads the parameter whole, as transformers wrote it
(``self.gate_up_proj[expert]``, ``grouped_mm`` over all experts). A module gathers all its
groups before it runs, so the pieces come together: each piece's gathered copy is put in its
place in one buffer on the compute device (`SplitParam`, allocated when the first piece is
gathered, freed when the last is released) and the parameter's ``.data`` is that buffer. This
buffer is the one whole-size copy, on the compute device only, while the module runs; the
capacity check counts it ([Note: the live budget], `joint_numel`). In backward the parameter's
gradient, whole, is cut into the pieces' slices as each piece's group flushes, and dropped once
every piece's group has flushed it. Whether a gradient reached the parameter (the no-grad rule,
[Note: parameters without a gradient are not stepped] in tiered/optim/runs.py) is the
parameter's, so all pieces agree: as in plain PyTorch, the fused tensor of an MoE layer any
token reached is stepped whole (an idle expert's rows get a zero gradient, as autograd gives
them), and one no token reached is not. Views of the buffer that autograd saves are kept as
references and rebuilt from the pieces if they were released (tiered/zero/saved.py), and
``gathered_parameters(modify=True)`` writes the buffer back into the pieces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from tiered.shards import ParamEntry


class SplitParam:
    """One parameter planned in pieces over several groups, and its whole buffer while gathered."""

    def __init__(
        self, param: nn.Parameter, shape: tuple[int, ...], pieces: Sequence[tuple[int, int]]
    ) -> None:
        self.param = param
        self.shape = shape
        self.numel = math.prod(shape)
        self.pieces = list(pieces)
        """(group index, entry index) of each piece, in order."""
        self.groups = [i for i, _ in self.pieces]
        self.buffer: torch.Tensor | None = None
        """The whole parameter on the compute device, while any piece is gathered."""
        self._gathered: set[int] = set()
        self._unflushed: set[int] = set(self.groups)
        """Groups that have not added this backward's gradient of the parameter yet."""

    def holds(self, t: torch.Tensor) -> bool:
        """`t` is the parameter's whole buffer (its ``.data`` while gathered)."""
        b = self.buffer
        return b is not None and t.data_ptr() == b.data_ptr() and t.numel() == b.numel()

    def attach(self, group: int, entry: ParamEntry, piece: torch.Tensor) -> None:
        """A piece was gathered (`piece`: its values): put it in place and point the parameter
        at the whole buffer."""
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=piece.dtype, device=piece.device)
        self.buffer[entry.start : entry.start + entry.numel].copy_(piece)
        self._gathered.add(group)
        self.param.data = self.buffer.view(self.shape)

    def detach(self, group: int, placeholder: torch.Tensor) -> None:
        """A piece was released; with the last one the parameter is emptied and the buffer freed."""
        self._gathered.discard(group)
        if not self._gathered:
            self.param.data = placeholder
            self.buffer = None

    def values_of(self, entry: ParamEntry) -> torch.Tensor | None:
        """The piece's current values in the whole buffer (after a modification in place)."""
        if self.buffer is None:
            return None
        return self.buffer[entry.start : entry.start + entry.numel]

    def grad_of(self, entry: ParamEntry) -> torch.Tensor | None:
        """The piece's slice of the parameter's gradient (flat), or None."""
        g = self.param.grad
        return None if g is None else g.reshape(-1)[entry.start : entry.start + entry.numel]

    def unflushed(self, group: int) -> bool:
        return group in self._unflushed

    def flushed(self, group: int) -> None:
        """`group` added its slice of the gradient; the gradient goes once every piece's group did."""
        self._unflushed.discard(group)
        if not self._unflushed:
            self.param.grad = None
            self._unflushed = set(self.groups)

    def forget_grad(self) -> None:
        """The gradient is dropped (zeroed) before every piece took its slice."""
        self.param.grad = None
        self._unflushed = set(self.groups)


# What a group does with each entry, a whole parameter or a piece of one (`split`):
def put(
    p: nn.Parameter, entry: ParamEntry, split: SplitParam | None, values: torch.Tensor, group: int
) -> None:
    """Gathered: the parameter's ``.data`` is `values`, or its piece goes into the whole buffer."""
    if split is None:
        p.data = values.view(entry.shape)
    else:
        split.attach(group, entry, values)


def empty(p: nn.Parameter, split: SplitParam | None, placeholder: torch.Tensor, group: int) -> None:
    """Released: the parameter is emptied (a piece's: with the last piece)."""
    if split is None:
        p.data = placeholder
    else:
        split.detach(group, placeholder)


def grad_of(p: nn.Parameter, entry: ParamEntry, split: SplitParam | None) -> torch.Tensor | None:
    """The entry's gradient: the parameter's, or a piece's slice of it."""
    return p.grad if split is None else split.grad_of(entry)


def drop_grad(p: nn.Parameter, split: SplitParam | None, group: int, *, flushed: bool) -> None:
    """The entry's gradient is done with (`flushed`: added to its partition, else zeroed)."""
    if split is None:
        p.grad = None
    elif flushed:
        split.flushed(group)
    else:
        split.forget_grad()


def pieces_by_entry(
    entries: Sequence[ParamEntry], params: Sequence[nn.Parameter], splits: Mapping[int, SplitParam]
) -> dict[int, SplitParam]:
    """Entry index -> its parameter, for a group's entries that are pieces of one."""
    return {j: splits[id(p)] for j, (e, p) in enumerate(zip(entries, params, strict=True)) if e.is_piece}


def split_params(
    planned_params: Sequence[Sequence[nn.Parameter]],
) -> dict[int, list[tuple[int, int]]]:
    """id(param) -> (group index, entry index) of each entry, for the parameters that are in more
    than one entry ([Note: fused parameters in pieces])."""
    where: dict[int, list[tuple[int, int]]] = {}
    for i, params in enumerate(planned_params):
        for j, p in enumerate(params):
            where.setdefault(id(p), []).append((i, j))
    return {k: v for k, v in where.items() if len(v) > 1}


def make_splits(
    pieces: Mapping[int, Sequence[tuple[int, int]]],
    groups: Sequence[tuple[Sequence[nn.Parameter], Sequence[ParamEntry]]],
) -> dict[int, SplitParam]:
    """id(param) -> its `SplitParam`, for the parameters in pieces (`pieces`: their (group, entry)
    places; `groups`: each group's parameters and entries)."""
    out = {}
    for pid, where in pieces.items():
        params, entries = groups[where[0][0]]
        out[pid] = SplitParam(params[where[0][1]], entries[where[0][1]].shape, where)
    return out


def params_once(
    groups: Sequence[tuple[Sequence[nn.Parameter], Sequence[ParamEntry]]],
) -> tuple[list[nn.Parameter], list[int], list[tuple[int, ...]]]:
    """Every managed parameter once (one in pieces is in several groups), its whole size and shape."""
    seen: dict[int, tuple[nn.Parameter, tuple[int, ...]]] = {}
    for params, entries in groups:
        for p, e in zip(params, entries, strict=True):
            seen.setdefault(id(p), (p, tuple(e.shape)))
    shapes = [s for _, s in seen.values()]
    return [p for p, _ in seen.values()], [math.prod(s) for s in shapes], shapes


def units_of(n_groups: int, splits: Iterable[SplitParam]) -> list[list[int]]:
    """The groups 0..n_groups-1 as units to gather together to read whole parameters: a group
    alone, or the groups of the pieces of the same parameters, by their first group."""
    root = list(range(n_groups))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for sp in splits:
        for g in sp.groups[1:]:
            a, b = find(sp.groups[0]), find(g)
            root[max(a, b)] = min(a, b)
    units: dict[int, list[int]] = {}
    for i in range(n_groups):
        units.setdefault(find(i), []).append(i)
    return [units[k] for k in sorted(units)]


def groups_of_params(
    params: Iterable[nn.Parameter],
    managed: dict[int, tuple[int, int]],
    pieces: dict[int, list[tuple[int, int]]],
) -> list[int]:
    """The sorted group indices holding `params` (every piece of a parameter in pieces)."""
    out: set[int] = set()
    for p in params:
        if id(p) in pieces:
            out.update(i for i, _ in pieces[id(p)])
        elif id(p) in managed:
            out.add(managed[id(p)][0])
    return sorted(out)
