"""Leaf modules: a subtree gathered whole on entry and reduced whole at its backward boundary.

[Note: leaf modules]
Under ZeRO-3 every gather (an all-gather of a group's shards) and every gradient reduction (a
reduce-scatter) is a collective, issued when the module runs or when its gradients are
complete: in graph order. Ranks whose graphs differ (a router sending rank 0's tokens to experts
{0, 1, 2} and rank 1's to {2, 3}; a branch one rank takes; a weight one rank's micro-batch does
not use) would issue different collectives and hang, or worse, pair two groups of equal size and
average the wrong gradients. DeepSpeed's answer is the *leaf module* (``set_z3_leaf_modules``,
``zero_optimization.leaf_module``: classes, names, name suffixes): a module every rank runs, whose
descendants' parameters are fetched all at once on entry. FSDP2 has the same unit implicitly:
one ``fully_shard`` module is one all-gather in pre-forward and one reduce-scatter in its
post-backward, whatever its children do. tiered takes both halves:

- Planning: a leaf's parameters (its whole subtree) form groups of their own, never merged
  with parameters outside it (no cross-module persistent group, no enclosing block's group;
  see [Note: group planning]); they are split between parameters only where the groups would
  exceed the block cap. So the leaf owns its groups.
- Forward: entering the leaf gathers all its groups, in index order, on every rank; the
  descendants then find them gathered (a pin, no collective), whichever of them run.
- Backward: the leaf's output boundary gathers them all again; the descendants' gradients are
  recorded but no group of the leaf is flushed when "complete" (which depends on the routing).
  The leaf's *input* boundary (`CallInBackward` of tiered/zero/hooks.py, an identity autograd
  function around the inputs that require grad, run when the gradients of all of them are
  computed, i.e. when the subtree's
  backward is done: FSDP2's RegisterPostBackwardFunction, DeepSpeed's full backward hook on the
  leaf) flushes every group the leaf owns, in index order, on every rank: a parameter no token
  reached reduces zeros, and the OR-ed "received" mask keeps it from being stepped unless some
  rank used it ([Note: parameters without a gradient are not stepped] in tiered/optim/runs.py).
  A leaf none of whose inputs requires grad (the model itself, fed token ids) is flushed at the
  end of backward instead, where the ranks first agree which groups still hold gradients.
- While the leaf's backward runs its groups stay held (never released for room, frozen ones not
  rotated out as elsewhere), so no re-gather, whose count would depend on the routing, happens
  inside it; its boundary releases them.

The cost is memory: the whole leaf is live at once (the budget check at initialize counts it),
as in DeepSpeed. The identity node on the inputs changes the order in which autograd sums a
multi-consumer input's gradient, a last-bit difference from plain PyTorch (see [Note: hooks that
only dispatch]); only leaves have it. A leaf must have a forward of its own (an ``nn.ModuleList``
of experts is never called; its parent is the leaf). Leaves inside a leaf are part of it.
Defaults follow DeepSpeed: with no ``classes`` given, Mixtral's, Qwen2-MoE's and Qwen3-MoE's
sparse MoE blocks are leaves, and so is every MoE block of transformers 5's fused layout
(`fused_expert_blocks`: the module that runs an experts module, one whose ``num_experts`` is the
leading dimension of each of its 3-D parameters, as OLMoE's, DeepSeek-V2/V3's and gpt-oss's
experts are; peft's wrappers around it are looked through). Within a fused experts module the
experts a rank's tokens reach change the graph's shape, and with it when the block's other
groups (router, shared expert) complete their gradients; as a leaf the block reduces them
together, in the same order on every rank. Leaves are not otherwise guessed from the module
tree (say, every module holding an ``nn.ModuleList``): the same shape is a stack of decoder
layers, and guessing it would gather a whole model at once; ranks that diverge without a leaf
are caught instead by [Note: collective order check] (tiered/zero/order.py), whose error names
the module to declare.
Why the boundary is at the same place on every rank: the subtree's autograd nodes are created
after the boundary's, so the engine runs every ready one of them before the boundary and before
any node created ahead of the leaf; what the ranks do outside the leaf keeps its order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from tiered.errors import ConfigError

if TYPE_CHECKING:
    from tiered.config.schema import LeafModuleConfig
    from tiered.shards import ShardGroup

log = logging.getLogger(__name__)

_LEAF_FLAG = "_z3_leaf"
"""The attribute DeepSpeed's ``set_z3_leaf_modules`` sets; tiered honours it too."""


def _qualified(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def has_own_forward(module: nn.Module) -> bool:
    """The module's class defines forward (an ``nn.ModuleList`` does not: it is never called)."""
    return type(module).forward is not nn.Module.forward


def set_leaf_modules(model: nn.Module, leaf_module_classes: Iterable[type | str]) -> list[nn.Module]:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes` (types,
    bare or dotted class names) as a ZeRO-3 leaf, as DeepSpeed's ``set_z3_leaf_modules`` does
    (same flag: either call is honoured by `tiered.initialize`). Returns the modules marked;
    ValueError if none matched. Call it before `tiered.initialize`."""
    wanted = list(leaf_module_classes)
    marked = [m for m in model.modules() if _matches_class(m, wanted)]
    if not marked:
        raise ValueError(f"no module of {wanted} found in {type(model).__name__}")
    for m in marked:
        setattr(m, _LEAF_FLAG, True)
    return marked


def _matches_class(module: nn.Module, classes: Sequence[type | str]) -> bool:
    for c in classes:
        if isinstance(c, type):
            if isinstance(module, c):
                return True
        elif c in (type(module).__name__, _qualified(module)):
            return True
    return False


def find_leaf_modules(model: nn.Module, cfg: LeafModuleConfig) -> list[str]:
    """Qualified names of the outermost leaf modules of `model`, in `named_modules` order: those
    `cfg` names (classes, names, name suffixes) and those flagged by `set_leaf_modules`. Every
    entry the config wrote must match a module; a match without a forward of its own is refused."""
    modules = dict(model.named_modules())
    hits: dict[str, str] = {}  # module name -> why it is a leaf (for messages)
    prefix = "zero_optimization.leaf_module"
    for c in cfg.classes:
        found = [n for n, m in modules.items() if c in (type(m).__name__, _qualified(m))]
        if not found and cfg.customized_classes:
            raise ConfigError(
                f"{prefix}.classes: {c!r} matches no module of {type(model).__name__}; "
                "write a class name the model uses (bare or dotted) or remove it"
            )
        hits.update((n, f"{prefix}.classes {c!r}") for n in found)
    for name in cfg.names:
        if name not in modules:
            raise ConfigError(
                f"{prefix}.names: no module named {name!r} in {type(model).__name__} (names as "
                "model.named_modules() spells them, '' for the model itself)"
            )
        hits[name] = f"{prefix}.names {name!r}"
    for suffix in cfg.name_suffixes:
        found = [n for n in modules if n.endswith(suffix)]
        if not found:
            raise ConfigError(
                f"{prefix}.name_suffixes: no module name of {type(model).__name__} ends in {suffix!r}"
            )
        hits.update((n, f"{prefix}.name_suffixes {suffix!r}") for n in found)
    hits.update((n, "set_leaf_modules") for n, m in modules.items() if getattr(m, _LEAF_FLAG, False))
    if not cfg.customized_classes:  # DeepSpeed's default classes, and every fused MoE block
        for n in fused_expert_blocks(model):
            hits.setdefault(n, f"the MoE block of {type(modules[n]).__name__}'s fused experts")
    outermost: list[str] = []
    for name in modules:  # named_modules order: an ancestor comes before its descendants
        if name not in hits:
            continue
        if any(_inside(name, outer) for outer in outermost):
            log.debug("leaf module %r is inside leaf %r: part of it", name, outermost)
            continue
        m = modules[name]
        if not has_own_forward(m):
            parent = name.rpartition(".")[0]
            raise ConfigError(
                f"{hits[name]} makes {name!r} ({type(m).__name__}) a leaf module, but it has no forward "
                "of its own and is never called, so it cannot gather its children; declare the module "
                f"that runs them instead: {parent!r} ({type(modules[parent]).__name__})"
            )
        outermost.append(name)
    return outermost


def fused_expert_blocks(model: nn.Module) -> list[str]:
    """The modules that run a fused experts module (transformers 5's MoE layout: an ``experts``
    module whose ``num_experts`` is the leading dimension of its 3-D parameters), peft's wrappers
    around it looked through: the MoE blocks that are leaves by default ([Note: leaf modules])."""
    modules = dict(model.named_modules())
    out: list[str] = []
    for name, m in modules.items():
        n = getattr(m, "num_experts", None)
        fused = [p for p in m.parameters(recurse=False) if p.dim() >= 3]
        if not name or not isinstance(n, int) or not fused or any(p.shape[0] != n for p in fused):
            continue
        child, parent = name, name.rpartition(".")[0]
        while parent and (
            getattr(modules[parent], "base_layer", None) is modules[child]
            or not has_own_forward(modules[parent])
        ):  # a peft ParamWrapper around the experts (its base_layer), a container: the block is above
            child, parent = parent, parent.rpartition(".")[0]
        if parent and parent not in out:  # (never the model itself: that would gather all of it)
            out.append(parent)
    return out


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def leaf_of(name: str, leaves: Sequence[str]) -> str | None:
    """The leaf whose subtree holds module (or parameter) `name`, if any."""
    return next((leaf for leaf in leaves if name == leaf or _inside(name, leaf)), None)


@dataclass
class Leaf:
    """One leaf module at run time: what it gathers and what it flushes."""

    name: str
    groups: list[int]
    """Every group its subtree's parameters are in (what entering it gathers), sorted."""
    owned: list[int]
    """The trainable groups planned for it (flushed at its boundary), sorted."""
    open: bool = False
    """Its backward started and its boundary has not flushed yet."""


class LeafSet:
    """The model's leaves at run time, by module and by the groups they own."""

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        planned_leaf: Sequence[str | None],
        trainable: Sequence[bool],
        groups_of: Callable[[Iterable[nn.Parameter]], list[int]],
    ) -> None:
        """`planned_leaf[i]` / `trainable[i]`: group i's leaf (or None) and whether it is stepped;
        `groups_of(params)`: the groups holding them."""
        modules = dict(model.named_modules())
        self.by_module: dict[int, Leaf] = {}
        self.owner: dict[int, Leaf] = {}
        """group index -> the leaf that flushes it."""
        for name in names:
            m = modules[name]
            groups = groups_of(m.parameters())
            owned = [
                i for i, (lf, tr) in enumerate(zip(planned_leaf, trainable, strict=True)) if lf == name and tr
            ]
            leaf = Leaf(name, groups, owned)
            self.by_module[id(m)] = leaf
            self.owner.update((i, leaf) for i in owned)

    def __len__(self) -> int:
        return len(self.by_module)

    def close_all(self) -> None:
        """The pass ended: no leaf's backward is open any more."""
        for leaf in self.by_module.values():
            leaf.open = False


def passed_over(entries: Sequence[Any], params: Sequence[nn.Parameter], seen: set[int]) -> list[str]:
    """Names of a group's trainable parameters without a gradient in this backward (`seen`: ids
    whose gradient arrived), if some others of the group have one (a partly complete group: a
    routed-around expert); else []."""
    got = [id(p) in seen or p.grad is not None for p in params]
    if not any(got):
        return []
    return [e.name for e, p, g in zip(entries, params, got, strict=True) if p.requires_grad and not g]


def module_path(param_names: Sequence[str]) -> str:
    """The deepest module holding all of `param_names` (qualified parameter names)."""
    parts = [n.split(".")[:-1] for n in param_names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def describe_group(group: ShardGroup) -> str:
    names = [e.name for e in group.entries]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"group {group.name} (module {module_path(names)!r}: {shown})"


def _nearest_runnable(modules: dict[str, nn.Module], paths: Sequence[str]) -> str:
    """The nearest common ancestor of module `paths` that has a forward of its own."""
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    name = ".".join(common)
    while name and (name not in modules or not has_own_forward(modules[name])):
        name = name.rpartition(".")[0]
    return name


def local_context(
    names: Mapping[int, str], stack: Sequence[nn.Module], entered: Iterable[int], passed_over: list[list[str]]
) -> dict[str, Any]:
    """What this rank knows about a divergence, for `advise_leaf`: its forward stack, the modules
    it entered in this pass, and per involved group the parameters it passed over."""
    return {
        "stack": [names[id(m)] for m in stack],
        "entered": sorted(names[i] for i in entered),
        "passed_over": passed_over,
    }


def advise_leaf(
    model: nn.Module, groups: Sequence[ShardGroup], gathered: bool, ranks: Sequence[dict[str, Any]]
) -> str:
    """The leaf declaration that makes the ranks agree, from every rank's `local_context`:
    where some rank's backward passed over parameters of an involved group while it reached
    others (routed-around experts), their nearest runnable ancestor, per group; where the ranks
    gather different groups in forward, the deepest module of a rank's forward stack that every
    other rank entered too (it ran different children on different ranks); else the groups'
    modules' nearest common runnable ancestor."""
    modules = dict(model.named_modules())
    root = type(model).__name__
    unused = [sorted({n for r in ranks for n in r["passed_over"][k]}) for k in range(len(groups))]
    names = [_nearest_runnable(modules, [n.rpartition(".")[0] for n in u]) for u in unused if u]
    if not names and gathered:
        found = []
        for k, r in enumerate(ranks):
            others = [set(o["entered"]) for j, o in enumerate(ranks) if j != k]
            shared = [n for n in r["stack"] if all(n in o for o in others)]
            if shared:
                found.append("" if shared[-1] == root else shared[-1])
        deepest = max((n.count(".") + bool(n) for n in found), default=0)
        names = [n for n in found if n.count(".") + bool(n) == deepest]
    if not names:
        names = [_nearest_runnable(modules, [module_path([e.name for e in g.entries]) for g in groups])]
    names = list(dict.fromkeys(names))
    classes = list(dict.fromkeys(type(modules[n]).__name__ for n in names))
    where = ", ".join(f"module {n!r}" if n else "the model itself" for n in names)
    quoted = ", ".join(f'"{c}"' for c in classes)
    spelled = ", ".join(f'"{n}"' for n in names)
    return (
        f"Declare {where} ({', '.join(classes)}), which every rank runs, a ZeRO-3 leaf module so that it "
        f'gathers and reduces its whole subtree at once: "zero_optimization": {{"leaf_module": '
        f'{{"classes": [{quoted}]}}}} (or "names": [{spelled}]), or call '
        f"tiered.zero.set_leaf_modules(model, [{', '.join(classes)}]) before tiered.initialize"
    )
