"""Which parameters go in which flat group, decided once from the module tree.

[Note: group planning]
Modules are walked in registration order (`named_modules`), which for Hugging Face models and
ordinary `nn.Sequential`-style code matches execution order; the trace recorded on the first
step gives the real order for prefetching, so a wrong guess costs only the first step's
prefetch, never correctness. Each module's direct parameters form one group, split (between
parameters, never inside one) when they exceed ``sub_group_size``. Neighbouring modules are NOT
merged up to ``sub_group_size``: that cap is DeepSpeed's optimizer granularity (1e9 elements
by default) and merging up to it would make the gather unit the whole model, defeating
per-layer fetching. Small parameters (``numel <= stage3_param_persistence_threshold``, up to
``stage3_model_persistence_threshold`` in total) go into separate *persistent* groups, merged
across modules up to ``sub_group_size``: they stay resident in the "gpu" tier, so that norms and
biases never cost a fetch. A shared (tied) parameter belongs to the group of the first module
that owns it; later owners gather that group too.

Blocks: a module whose class is named in ``block_types`` (by default the Hugging Face model's own
``_no_split_modules``: ``LlamaDecoderLayer``, ``GPT2Block``, ... the unit accelerate's FSDP
auto-wrap uses) puts all its parameters, its submodules' included, into one group. A decoder layer
is then one gather and one optimizer sub-group instead of nine (measured on the 35.7M-parameter
Llama of benchmarks/step.py: 75 groups -> 11), and each group costs a fixed number of tier-manager
round trips per step, whatever its size. Submodules of a block still dispatch their own hooks;
they find the block's group resident. A block larger than ``max_block_numel`` (the engine passes
half of ``stage3_max_live_parameters`` and a quarter of the gpu tier's budget, so the current and
the prefetched next block fit) is planned module by module instead: tight budgets keep working.

Pieces ([Note: fused parameters in pieces] in tiered/zero/split.py): a fused expert parameter
(3 or more dimensions, experts first) larger than the group cap is planned as consecutive runs
of whole experts, each at most the cap (one expert at least), placed as parameters are; every
other parameter is whole in one group.

Leaves ([Note: leaf modules] in tiered/zero/leaf.py): a leaf module's parameters, its whole
subtree's, go into groups of their own, in order, split between parameters only above the block
cap (and ``sub_group_size``), never into a persistent group and never into an enclosing block's
group (which then holds the block's other parameters): the leaf owns what it flushes.

[Note: frozen parameters]
A parameter with ``requires_grad=False`` at initialize is frozen: plain PyTorch never changes it
(it gets no gradient, so AdamW skips it: no weight decay, no state). Groups are therefore split
into a trainable and a frozen part; a frozen group has no gradient partition and no optimizer
state (for a frozen base model that is 16 bytes per parameter of host RAM or NVMe not spent)
and the optimizer never touches it. ``requires_grad`` is read once, at initialize.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class PlannedGroup:
    """A group before its partitions exist: (qualified name, parameter) pairs in order."""

    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    persistent: bool = False
    trainable: bool = True
    """Every parameter requires grad (or, if False, none does): see [Note: frozen parameters]."""
    leaf: str | None = None
    """The leaf module whose subtree this group holds (see [Note: leaf modules]), or None."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Per entry, (first element, elements) of its parameter it holds: the whole, (0, numel), or
    a piece ([Note: fused parameters in pieces] in tiered/zero/split.py)."""

    def add(self, qual: str, p: nn.Parameter, span: tuple[int, int] | None = None) -> None:
        self.params.append((qual, p))
        self.spans.append((0, p.numel()) if span is None else span)

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.spans)

    def slots(self) -> list[tuple[str, nn.Parameter, int, int]]:
        """(name, parameter, first element, elements) of each entry."""
        return [(q, p, a, n) for (q, p), (a, n) in zip(self.params, self.spans, strict=True)]


def pieces_of(p: nn.Parameter, cap: int) -> list[tuple[int, int]]:
    """(first element, elements) of the pieces `p` is planned in: the whole, or, for a fused
    expert tensor (3 or more dimensions) larger than `cap`, runs of whole experts of at most
    `cap` elements, one expert at least ([Note: fused parameters in pieces])."""
    n = p.numel()
    if n <= cap or p.dim() < 3 or p.shape[0] < 2:
        return [(0, n)]
    row = n // p.shape[0]
    per = max(1, cap // row)
    return [(r * row, min(per, p.shape[0] - r) * row) for r in range(0, p.shape[0], per)]


def plan_param_groups(
    model: nn.Module,
    *,
    sub_group_size_numel: int,
    param_persistence_threshold_numel: int,
    model_persistence_threshold_numel: int,
    block_types: frozenset[str] | None = None,
    max_block_numel: int | None = None,
    leaves: Sequence[str] = (),
) -> list[PlannedGroup]:
    """Split `model`'s parameters into flat groups (which parameter goes in which group). See [Note: group planning]; `block_types` (class
    names) defaults to the model's ``_no_split_modules``; `leaves` are the outermost leaf modules' names."""
    if block_types is None:
        block_types = frozenset(getattr(model, "_no_split_modules", None) or ())
    if sub_group_size_numel <= 0:
        raise ValueError(f"sub_group_size must be positive, got {sub_group_size_numel}")
    seen: set[int] = set()
    groups: list[PlannedGroup] = []
    modules = dict(model.named_modules())
    for leaf in leaves:  # first: a leaf's parameters are its own, even where a block encloses it
        seen.update(id(p) for p in modules[leaf].parameters())
    leaf_placed: set[int] = set()  # (a parameter shared by two leaves is the first one's)
    persistent: PlannedGroup | None = None
    persistent_total = 0
    block_prefix: str | None = None  # inside a block: its submodules' params are already placed
    leaf_prefix: str | None = None  # inside a leaf: placed with it
    for mname, module in model.named_modules():
        if leaf_prefix is not None and (leaf_prefix == "" or mname.startswith(leaf_prefix)):
            continue
        if mname in leaves:
            groups.extend(
                _leaf_groups(
                    mname, module, min(sub_group_size_numel, max_block_numel or sys.maxsize), leaf_placed
                )
            )
            leaf_prefix = f"{mname}." if mname else ""
            continue
        if block_prefix is not None and mname.startswith(block_prefix):
            continue
        is_block = (
            type(module).__name__ in block_types
            and mname != ""
            and (max_block_numel is None or sum(p.numel() for p in module.parameters()) <= max_block_numel)
        )
        block_prefix = f"{mname}." if is_block else None
        current = PlannedGroup()
        for pname, p in module.named_parameters(recurse=is_block):
            if id(p) in seen or p.numel() == 0:
                continue
            seen.add(id(p))
            qual = f"{mname}.{pname}" if mname else pname
            n = p.numel()
            if (
                n <= param_persistence_threshold_numel
                and persistent_total + n <= model_persistence_threshold_numel
            ):
                persistent_total += n
                if persistent is None or persistent.numel + n > sub_group_size_numel:
                    persistent = PlannedGroup(persistent=True)
                    groups.append(persistent)
                persistent.add(qual, p)
                continue
            for span in pieces_of(p, sub_group_size_numel):
                if current.params and current.numel + span[1] > sub_group_size_numel:
                    groups.append(current)
                    current = PlannedGroup()
                current.add(qual, p, span)
        if current.params:
            groups.append(current)
    return _split_by_trainability(groups)


def _leaf_groups(name: str, module: nn.Module, cap: int, placed: set[int]) -> list[PlannedGroup]:
    """A leaf's parameters (its subtree's, each once), in order, split between parameters above `cap`."""
    out: list[PlannedGroup] = []
    current = PlannedGroup(leaf=name)
    for pname, p in module.named_parameters():
        if id(p) in placed or p.numel() == 0:
            continue
        placed.add(id(p))
        for span in pieces_of(p, cap):
            if current.params and current.numel + span[1] > cap:
                out.append(current)
                current = PlannedGroup(leaf=name)
            current.add(f"{name}.{pname}" if name else pname, p, span)
    if current.params:
        out.append(current)
    return out


def _split_by_trainability(groups: list[PlannedGroup]) -> list[PlannedGroup]:
    """Each group becomes its trainable part followed by its frozen part (when both exist), so
    a group is stepped whole or not at all. See [Note: frozen parameters]."""
    out = []
    for g in groups:
        for trainable in (True, False):
            part = PlannedGroup([], g.persistent, trainable, g.leaf)
            for q, p, a, n in g.slots():
                if p.requires_grad == trainable:
                    part.add(q, p, (a, n))
            if part.params:
                out.append(part)
    return out


def check_no_meta_mix(model: nn.Module) -> bool:
    """True if the model's parameters are on the meta device (all of them); error on a mix."""
    devices = {p.device.type for p in model.parameters()}
    if "meta" in devices and len(devices) > 1:
        raise ValueError(
            "model has parameters both on the meta device and materialised "
            f"({sorted(devices)}): build it entirely on meta (with torch.device('meta')) or not at all"
        )
    return devices == {"meta"}


def flat_fp32(slots: list[tuple[str, nn.Parameter, int, int]], full_numel: int) -> torch.Tensor:
    """The group's full flat buffer in fp32 (padding zero), from the parameters' current data
    (`PlannedGroup.slots`: a piece takes its part)."""
    out = torch.zeros(full_numel, dtype=torch.float32)
    off = 0
    for _, p, a, n in slots:
        out[off : off + n].copy_(p.detach().reshape(-1)[a : a + n])
        off += n
    return out
