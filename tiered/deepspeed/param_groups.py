"""DeepSpeed's `model_parameters` and client optimizers, turned into what tiered's engine takes.

[Note: param groups as per-parameter hyper-parameters]
tiered's offloaded Adam steps flat shard groups, not torch param groups: a parameter group of a
script (``{"params": [...], "weight_decay": 0.0}``, the usual no-decay group of biases and norms)
becomes one `ParamHyper` per parameter, keyed by its qualified name, with the group's weight decay
and its lr as a multiple of the base lr (``lr_scale``). The base hyper-parameters (lr, betas,
eps, the default weight decay) stay the config's ``optimizer`` section; a client optimizer (torch
Adam/AdamW, DeepSpeed's DeepSpeedCPUAdam/FusedAdam) becomes that section, its first group the
base. betas and eps are one per run (the fused kernel takes one pair), so groups that differ in
them are refused, as is a group key tiered would not honour. A parameter of the model that needs
a gradient but is in no group would silently stay untrained under DeepSpeed's semantics only if
tiered froze it: it is refused instead, naming it (set ``requires_grad_(False)`` or list it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiered.errors import ConfigError, UnsupportedConfigError
from tiered.optim.hyper import ParamHyper

# keys a param group may carry and what honours them ("params" and "name" are bookkeeping)
_GROUP_KEYS = {"params", "name", "lr", "weight_decay", "betas", "eps", "initial_lr"}
# torch optimizers' own group keys whose non-default value changes the math
_TORCH_FLAGS_OFF = {"amsgrad": False, "maximize": False}
_TORCH_FLAGS_ANY = {"foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
SUPPORTED_OPTIMIZERS = ("torch.optim.AdamW", "torch.optim.Adam", "DeepSpeedCPUAdam", "FusedAdam")


@dataclass(frozen=True)
class ResolvedGroups:
    """The script's param groups by parameter name, and the optimizer section they imply."""

    groups: list[dict[str, Any]]
    """One dict per group: "names" (qualified names), and the group's "lr"/"weight_decay" if set."""
    optimizer_section: dict[str, Any] | None
    """A client optimizer's config section (None: the config's own is the base)."""


def _describe(p: Any) -> str:
    if isinstance(p, torch.Tensor):
        return f"a tensor of shape {tuple(p.shape)} ({p.dtype})"
    return f"a {type(p).__name__}"


def resolve_model_parameters(model: torch.nn.Module, model_parameters: Any) -> list[dict[str, Any]]:
    """`model_parameters` (parameters, or param-group dicts) as groups of qualified names.
    Raises ConfigError naming what is not one of the model's parameters, or is listed twice."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    if isinstance(model_parameters, torch.Tensor) or isinstance(model_parameters, Mapping):
        model_parameters = [model_parameters]
    items = list(model_parameters)
    if items and all(isinstance(x, Mapping) for x in items):
        raw_groups = [dict(x) for x in items]
    elif any(isinstance(x, Mapping) for x in items):
        raise ConfigError(
            "model_parameters mixes parameters and param-group dicts; pass either parameters or dicts "
            '({"params": [...], "weight_decay": ...})'
        )
    else:
        raw_groups = [{"params": items}]
    seen: dict[str, int] = {}
    groups: list[dict[str, Any]] = []
    foreign: list[str] = []
    for gi, raw in enumerate(raw_groups):
        unknown = sorted(set(raw) - _GROUP_KEYS - _TORCH_FLAGS_ANY - set(_TORCH_FLAGS_OFF))
        if unknown:
            raise ConfigError(
                f"model_parameters group {gi}: key {', '.join(map(repr, unknown))} is not honoured by "
                f"tiered's Adam; a group may set {', '.join(sorted(_GROUP_KEYS - {'params', 'name'}))}"
            )
        for flag, off in _TORCH_FLAGS_OFF.items():
            if raw.get(flag, off) != off:
                raise UnsupportedConfigError(
                    f"param group {gi}: {flag}={raw[flag]!r} is not supported by tiered's Adam"
                )
        if "params" not in raw:
            raise ConfigError(f"model_parameters group {gi} has no 'params'")
        params = raw["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = []
        for pi, p in enumerate(params):
            name = name_of.get(id(p)) if isinstance(p, torch.Tensor) else None
            if name is None:
                foreign.append(f"group {gi} item {pi} ({_describe(p)})")
                continue
            if name in seen:
                raise ConfigError(
                    f"parameter {name!r} is in model_parameters group {seen[name]} and group {gi}; list it once"
                )
            seen[name] = gi
            names.append(name)
        group: dict[str, Any] = {"names": names}
        for key in ("lr", "weight_decay", "betas", "eps"):
            if key in raw:
                group[key] = raw[key]
        groups.append(group)
    if foreign:
        shown = "; ".join(foreign[:5]) + (f"; and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(
            f"model_parameters holds {len(foreign)} tensor(s) that are not parameters of the model passed "
            f"to initialize: {shown}. Pass model.parameters() (or groups of them) of that same model"
        )
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(
            f"{len(missing)} trainable parameter(s) of the model are in no model_parameters group: {shown}; "
            "list them, or call requires_grad_(False) on the ones not to train"
        )
    return groups


def _is_torch_adam(opt: Any) -> bool:
    return type(opt) in (torch.optim.Adam, torch.optim.AdamW)


def client_optimizer_groups(model: torch.nn.Module, optimizer: Any) -> ResolvedGroups:
    """A client optimizer, translated: its param groups and its hyper-parameters as an
    ``optimizer`` config section. Refuses an optimizer with state or one tiered cannot offload."""
    cls = type(optimizer).__name__
    if not (_is_torch_adam(optimizer) or cls in ("DeepSpeedCPUAdam", "FusedAdam")):
        raise UnsupportedConfigError(
            f"client optimizer {type(optimizer).__module__}.{cls} cannot be offloaded by tiered: tiered runs "
            f"its own offloaded Adam and translates only {', '.join(SUPPORTED_OPTIMIZERS)}; pass one of those, "
            'or no optimizer and an "optimizer" section in the config'
        )
    if any(len(s) for s in getattr(optimizer, "state", {}).values()):
        raise ConfigError(
            f"client optimizer {cls} already has state (it has stepped): tiered starts Adam from empty "
            "state; pass a fresh optimizer, or load a tiered checkpoint with engine.load_checkpoint"
        )
    pgs = list(optimizer.param_groups)
    if not pgs:
        raise ConfigError(f"client optimizer {cls} has no param groups")
    if cls == "DeepSpeedCPUAdam":
        adamw = bool(getattr(optimizer, "adam_w_mode", getattr(optimizer, "adamw_mode", True)))
    elif cls == "FusedAdam":
        adamw = bool(getattr(optimizer, "adam_w_mode", True))
    else:
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(pgs[0].get("decoupled_weight_decay", False))
    for gi, g in enumerate(pgs):
        if g.get("bias_correction", True) is not True:
            raise UnsupportedConfigError(
                f"client optimizer {cls} group {gi}: bias_correction=False is not supported"
            )
        if isinstance(g.get("lr"), torch.Tensor):
            raise UnsupportedConfigError(
                f"client optimizer {cls} group {gi}: a tensor lr is not supported; use a float"
            )
    base = pgs[0]
    section = {
        "type": "AdamW" if adamw else "Adam",
        "params": {
            "lr": float(base["lr"]),
            "betas": [float(b) for b in base["betas"]],
            "eps": float(base["eps"]),
            "weight_decay": float(base.get("weight_decay", 0.0)),
            **({} if adamw else {"adam_w_mode": False}),
        },
    }
    dicts = []
    for g in pgs:
        d = {k: v for k, v in g.items() if k in _GROUP_KEYS or k in _TORCH_FLAGS_OFF}
        dicts.append(d)
    return ResolvedGroups(resolve_model_parameters(model, dicts), section)


def param_hyper_of(
    groups: list[dict[str, Any]], *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> tuple[dict[str, ParamHyper] | None, list[float]]:
    """Per-parameter `ParamHyper` for every listed parameter, or None when every group has the
    base values (nothing to pass); and each group's lr scale. See
    [Note: param groups as per-parameter hyper-parameters]."""
    out: dict[str, ParamHyper] = {}
    scales: list[float] = []
    for gi, g in enumerate(groups):
        for key, base in (("betas", betas), ("eps", eps)):
            if key in g and not _close(g[key], base):
                raise UnsupportedConfigError(
                    f"param group {gi}: {key}={g[key]!r} differs from the optimizer's {base!r}; tiered's Adam "
                    f"takes one {key} for every parameter (groups may differ in lr and weight_decay only)"
                )
        g_lr = float(g.get("lr", lr))
        scale = g_lr / lr if lr > 0 else 1.0
        scales.append(scale)
        hyper = ParamHyper(weight_decay=float(g.get("weight_decay", weight_decay)), lr_scale=scale)
        for name in g["names"]:
            out[name] = hyper
    default = ParamHyper(weight_decay=float(weight_decay), lr_scale=1.0)
    if all(_close(h.weight_decay, default.weight_decay) and _close(h.lr_scale, 1.0) for h in out.values()):
        return None, scales
    return out, scales


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)


def names_of(groups: Iterable[dict[str, Any]]) -> list[str]:
    return [n for g in groups for n in g["names"]]
