"""LoRA adapters through peft: the `--lora` spec, applying it, and counting adapter parameters.

[Note: LoRA through tiered]
`--lora r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj,o_proj` wraps the model with
peft's `get_peft_model(model, LoraConfig(...))` before the engine is built. peft freezes every
base parameter (requires_grad=False) and adds trainable lora_A / lora_B weights; tiered then
partitions all of them as usual, and frozen parameters get no gradient partition and no
optimizer state (they stay in their offload tier, are gathered for compute and never written),
so only the adapters are stepped. Keys left out of the spec take peft's defaults (alpha 8,
dropout 0.0, targets: peft's per-architecture default, e.g. q_proj,v_proj for Llama); `r` is
required. Target names are matched against the last component of module names, as peft does.

A target spelled ``module.parameter`` that names an ``nn.Parameter`` of a module that is no
linear layer (``experts.gate_up_proj``, ``experts.down_proj``: the fused expert tensors of the
MoE classes of transformers 5) goes to peft's ``target_parameters`` instead: peft's
``ParamWrapper`` then registers a parametrization (W + the adapters' delta, per expert) for the
length of each forward, which the ZeRO-3 hooks see as the same parameter (own_param_ids in
tiered/zero/sharding.py). A bare name (``down_proj``) stays a module target, as in peft: in
Qwen2-MoE it is the shared expert's linear layer, not the fused experts.

A wrapped multimodal model ([Note: wrapped models train their language model] in
tiered/planning/text_model.py) gets adapters in its language model only: its vision tower has
``q_proj`` / ``v_proj`` layers too, which text never reaches (peft's ``target_modules`` is then
the regular expression of the targets under the language model).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from tiered.errors import ConfigError, TieredError

log = logging.getLogger(__name__)

SPEC_KEYS = ("r", "alpha", "dropout", "targets")
EXAMPLE = "r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj,o_proj"


@dataclass(frozen=True)
class LoraSpec:
    """What `--lora` asked for; None = peft's default ([Note: LoRA through tiered])."""

    r: int
    alpha: float | None = None
    dropout: float | None = None
    targets: tuple[str, ...] | None = None

    def describe(self) -> str:
        return (
            f"r={self.r}, alpha={'peft default' if self.alpha is None else f'{self.alpha:g}'}, "
            f"dropout={'peft default' if self.dropout is None else f'{self.dropout:g}'}, "
            f"targets={'peft default' if self.targets is None else ','.join(self.targets)}"
        )


def parse_lora_spec(spec: str, option: str = "--lora") -> LoraSpec:
    """`r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj` (a bare number is r). Items without
    `=` continue the targets list."""
    spec = spec.strip()
    if spec.isdigit():
        spec = f"r={spec}"
    values: dict[str, list[str]] = {}
    last: str | None = None
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise ConfigError(f"{option} {spec!r}: an empty item (two commas?); e.g. {option} {EXAMPLE}")
        if "=" in item:
            key, _, val = item.partition("=")
            key = key.strip()
            if key not in SPEC_KEYS:
                raise ConfigError(f"{option} {spec!r}: unknown key {key!r}; keys are {', '.join(SPEC_KEYS)}")
            if key in values:
                raise ConfigError(f"{option} {spec!r}: {key} given twice")
            values[key] = [val.strip()]
            last = key
        elif last == "targets":
            values["targets"].append(item)
        else:
            raise ConfigError(f"{option} {spec!r}: {item!r} is not key=value; e.g. {option} {EXAMPLE}")
    if "r" not in values:
        raise ConfigError(f"{option} {spec!r}: r (the adapter rank) is required; e.g. {option} {EXAMPLE}")

    def number(key: str, kind: type) -> Any:
        raw = values[key][0]
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(
                f"{option} {spec!r}: {key}={raw!r} is not a{'n integer' if kind is int else ' number'}"
            ) from None

    r = number("r", int)
    if r < 1:
        raise ConfigError(f"{option} {spec!r}: r must be >= 1, got {r}")
    alpha = number("alpha", float) if "alpha" in values else None
    dropout = number("dropout", float) if "dropout" in values else None
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{option} {spec!r}: dropout must be in [0, 1), got {dropout}")
    targets = None
    if "targets" in values:
        targets = tuple(values["targets"])
        if not all(targets):
            raise ConfigError(f"{option} {spec!r}: targets needs module names, e.g. targets=q_proj,v_proj")
    return LoraSpec(r, alpha, dropout, targets)


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise TieredError("--lora needs peft; pip install 'tiered[hf]'") from exc
    return peft


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name components of the model's nn.Linear modules (what targets match)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def parameter_targets(model: nn.Module, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The targets that name a parameter (``module.parameter``, e.g. ``experts.gate_up_proj``) of a
    module that is no linear layer: peft's ``target_parameters`` ([Note: LoRA through tiered])."""
    out = []
    for t in targets:
        if "." not in t:
            continue
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                continue
            for pname, _ in m.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                if full == t or full.endswith("." + t):
                    out.append(t)
                    break
            else:
                continue
            break
    return tuple(out)


def fused_parameter_names(model: nn.Module) -> list[str]:
    """``module.parameter`` of the parameters of 3 or more dimensions held by modules that are no
    linear layers (fused experts): what a parameter target may name."""
    return sorted(
        {
            f"{name.rsplit('.', 1)[-1]}.{pname}"
            for name, m in model.named_modules()
            if not isinstance(m, nn.Linear)
            for pname, p in m.named_parameters(recurse=False)
            if p.dim() >= 3
        }
    )


def resolve_targets(model: nn.Module, spec: LoraSpec) -> tuple[str, ...]:
    """The spec's targets, or peft's default for the model type; each must name a module (or a
    parameter: `parameter_targets`)."""
    if spec.targets is None:
        mapping = _peft().utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in mapping:
            raise ConfigError(
                f"--lora: peft has no default targets for model type {model_type!r}; add targets=..., "
                f"e.g. from the model's linear layers: {', '.join(linear_names(model))}"
            )
        targets = tuple(mapping[model_type])
    else:
        targets = spec.targets
    have = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    params = set(parameter_targets(model, targets))
    missing = [t for t in targets if t not in have and t not in params]
    if missing:
        fused = fused_parameter_names(model)
        raise ConfigError(
            f"--lora targets {', '.join(missing)}: the model has no such modules; its linear layers are "
            f"{', '.join(linear_names(model))}"
            + (f"; its fused expert parameters (module.parameter) are {', '.join(fused)}" if fused else "")
        )
    return targets


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """`model` wrapped by peft with `spec` ([Note: LoRA through tiered]): base frozen, adapters trainable."""
    peft = _peft()
    targets = resolve_targets(model, spec)
    params = parameter_targets(model, targets)
    modules: list[str] | str = [t for t in targets if t not in params]
    scope = _language_model(model)
    if scope and modules:  # only the language model's layers ([Note: LoRA through tiered])
        modules = rf"{re.escape(scope)}\..*\.({'|'.join(re.escape(t) for t in modules)})"
    kwargs: dict[str, Any] = {
        "r": spec.r,
        "target_modules": modules,
        "task_type": "CAUSAL_LM",
    }
    if params:
        kwargs["target_parameters"] = list(params)
    if spec.alpha is not None:
        kwargs["lora_alpha"] = spec.alpha
    if spec.dropout is not None:
        kwargs["lora_dropout"] = spec.dropout
    wrapped: nn.Module = peft.get_peft_model(model, peft.LoraConfig(**kwargs))
    return wrapped


def _language_model(model: nn.Module) -> str:
    """The language model's name in a wrapped multimodal model; "" for a plain causal LM."""
    from tiered.planning.text_model import is_wrapped, language_model_of

    if not is_wrapped(getattr(model, "config", None)):
        return ""
    return language_model_of(model)[0]


def adapter_params(model: nn.Module, spec: LoraSpec) -> int:
    """Adapter parameters `spec` adds to `model` (may be on the meta device): r x (in + out) per
    targeted nn.Linear, as peft's default LoRA layer (no bias, no DoRA); r x E x (in + out) per
    targeted fused expert parameter [E, out, in] (peft's ParamWrapper: one rank-r pair per expert)."""
    resolved = resolve_targets(model, spec)
    params = set(parameter_targets(model, resolved))
    targets = set(resolved) - params
    scope = _language_model(model)
    total = 0
    for name, m in model.named_modules():
        if scope and not name.startswith(scope + "."):
            continue
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            total += spec.r * (m.in_features + m.out_features)
        if isinstance(m, nn.Linear) or not params:
            continue
        for pname, p in m.named_parameters(recurse=False):
            full = f"{name}.{pname}"
            if any(full == t or full.endswith("." + t) for t in params):
                experts = p.shape[0] if p.dim() >= 3 else 1
                total += spec.r * experts * (p.shape[-1] + p.shape[-2])
    if total == 0:
        raise ConfigError(
            f"--lora targets {', '.join(sorted(targets))}: none of them is a linear layer; the model's are "
            f"{', '.join(linear_names(model))}"
        )
    return total


def save_adapter(engine: Any, model: nn.Module, directory: str, *, base_model: Any = None) -> str:
    """The trained adapters in peft's own format (adapter_config.json, adapter_model.safetensors:
    what ``PeftModel.from_pretrained(base, directory)`` loads), gathered from the engine. Only
    the adapter parameters are gathered ([Note: exporting a peft model]). Every rank calls it;
    rank 0 writes."""
    from tiered.checkpoint.export import write_peft_adapter

    _peft()
    names = {id(p): n for n, p in model.named_parameters()}
    adapter = [p for p in model.parameters() if p.requires_grad]
    with engine.gathered_parameters(adapter):
        values = {names[id(p)]: p.detach().to("cpu", copy=True).contiguous() for p in adapter}
    if engine.rank != 0:  # every rank took part in the gather; rank 0 writes
        return directory
    return write_peft_adapter(model, values, directory, base_model=base_model)
