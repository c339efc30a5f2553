"""Training hyper-parameters a caller supplies (`tiered.initialize(..., lr=...)`), and the rule
that none is ever invented.

[Note: caller-supplied hyper-parameters]
A DeepSpeed config written for Hugging Face's Trainer leaves the training hyper-parameters to the
Trainer: ``"auto"``, or no ``optimizer`` section at all. tiered fills them only from what the
caller says, with the rules of transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process``
/ ``trainer_config_finalize`` (`fill_match`):

- a key whose value is ``"auto"`` takes the caller's value;
- a key with a value and a caller's value that differs is an error naming both (HF refuses the
  same mismatch: the config and the caller must agree, neither silently wins);
- a key the config does not have: ``optimizer`` missing entirely builds AdamW from exactly the
  caller's lr, betas, eps and weight_decay; of these a value the caller did not give means
  torch's AdamW default for betas (0.9, 0.999) and eps (1e-8) and *no* weight decay (0.0), the
  values DeepSpeed's own Adam uses for a missing key. Other missing keys take the caller's value
  (micro batch, accumulation, clipping) or keep DeepSpeed's meaning when the caller gives none.

A value neither the config nor the caller gives, where the config asked for one (``"auto"``, or
no ``optimizer`` section), is left *unset*: `TieredConfig.unset` lists its key path, and
`check_complete` (called by `tiered.initialize` before anything is built) raises ConfigError
naming the key and the keyword (or command-line flag) that supplies it. The value stored in an
unset field is a placeholder nothing reads. "auto" that HF derives from the model (the
hidden-size bucket sizes) is not a hyper-parameter: it is resolved from the model
([Note: auto from the model]). ``scheduler.params.warmup_min_lr: "auto"`` is 0, as HF fills it
(a constant, not a TrainingArguments value).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tiered.config.values import as_betas, as_count, as_float, is_auto
from tiered.errors import ConfigError

log = logging.getLogger(__name__)

MixedPrecision = Literal["no", "fp16", "bf16"]


@dataclass(frozen=True)
class Hyperparameters:
    """What a trainer knows and a DeepSpeed config may leave "auto". None: not supplied.

    The names follow `tiered.initialize`'s keywords; each maps to one config key (see `KEYWORD_OF`).
    """

    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    max_grad_norm: float | None = None
    mixed_precision: MixedPrecision | None = None

    def __post_init__(self) -> None:
        # Validate once, with the keyword's name, so a bad value never reaches the config.
        def kw(name: str) -> str:
            return f"{name}="

        if self.lr is not None:
            as_float(self.lr, kw("lr"), minimum=0.0, min_exclusive=True)
        if self.betas is not None:
            object.__setattr__(self, "betas", as_betas(self.betas, kw("betas")))
        if self.eps is not None:
            as_float(self.eps, kw("eps"), minimum=0.0, min_exclusive=True)
        if self.weight_decay is not None:
            as_float(self.weight_decay, kw("weight_decay"), minimum=0.0)
        for name in ("warmup_steps", "total_steps", "micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None:
                as_count(value, kw(name), minimum=0 if name == "warmup_steps" else 1)
        if self.max_grad_norm is not None:
            as_float(self.max_grad_norm, kw("max_grad_norm"), minimum=0.0)
        if self.mixed_precision is not None and self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ConfigError(f'mixed_precision={self.mixed_precision!r}: use "no", "fp16" or "bf16"')

    def given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))


# The config key each keyword fills, and the keyword each unset key needs.
KEYWORD_OF: dict[str, str] = {
    "optimizer": "lr",
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "lr",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "scheduler.params.total_num_steps": "total_steps",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "fp16.enabled": "mixed_precision",
    "bf16.enabled": "mixed_precision",
}


def _node(config: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding `path`'s last key (None if a parent is missing or not a dict)."""
    *parents, leaf = path.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return bool(a == b)


def apply_hyperparameters(
    config: dict[str, Any], hp: Hyperparameters
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A copy of raw `config` with `hp` filled in ([Note: caller-supplied hyper-parameters]),
    and the key paths still unset. Raises ConfigError for a value that contradicts the caller."""
    cfg = copy.deepcopy(config)
    mismatches: list[str] = []
    unset: list[str] = []

    def fill(
        path: str,
        value: Any,
        keyword: str,
        *,
        insert: bool = False,
        shown: Any = None,
        must_match: bool = True,
    ) -> None:
        node, leaf = _node(cfg, path)
        if node is None:
            return
        current = node.get(leaf)
        if current is not None and is_auto(current):
            if value is None:
                unset.append(path)
            else:
                node[leaf] = value
        elif current is None:
            if value is not None and insert:
                node[leaf] = value
        elif must_match and value is not None and not _same(current, value):
            given = value if shown is None else shown
            mismatches.append(f"{path} = {current!r} in the config but {keyword}={given!r} from the caller")

    # --- optimizer ------------------------------------------------------------------------
    if cfg.get("optimizer") is None:
        if hp.lr is None:
            unset.append("optimizer")
        else:
            params: dict[str, Any] = {"lr": hp.lr}
            if hp.betas is not None:
                params["betas"] = list(hp.betas)
            if hp.eps is not None:
                params["eps"] = hp.eps
            params["weight_decay"] = 0.0 if hp.weight_decay is None else hp.weight_decay
            cfg["optimizer"] = {"type": "AdamW", "params": params}
            log.info(
                "no optimizer section in the config: building AdamW(lr=%g, betas=%s, eps=%g, weight_decay=%g) "
                "from the caller's values%s",
                hp.lr,
                tuple(hp.betas or (0.9, 0.999)),
                1e-8 if hp.eps is None else hp.eps,
                params["weight_decay"],
                "" if hp.weight_decay is not None else " (weight_decay not supplied: no weight decay)",
            )
    elif isinstance(cfg["optimizer"], dict):
        opt = cfg["optimizer"]
        if opt.get("params") is None:
            opt["params"] = {}
        if isinstance(opt["params"], dict) and opt["params"].get("lr") is None:
            if hp.lr is None:
                unset.append("optimizer.params.lr")
            else:
                opt["params"]["lr"] = hp.lr
        fill("optimizer.params.lr", hp.lr, "lr")
        fill("optimizer.params.betas", None if hp.betas is None else list(hp.betas), "betas", insert=True)
        fill("optimizer.params.eps", hp.eps, "eps", insert=True)
        fill("optimizer.params.weight_decay", hp.weight_decay, "weight_decay", insert=True)

    # --- scheduler ------------------------------------------------------------------------
    sched = cfg.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("params"), dict):
        # HF's constant, fill_only (a config value stands): see the Note
        fill("scheduler.params.warmup_min_lr", 0.0, "warmup_min_lr", must_match=False)
        max_lr = sched["params"].get("warmup_max_lr")
        if max_lr is not None and is_auto(max_lr) and hp.lr is None:
            pass  # the optimizer's lr resolves it; if that is unset, its own entry says so
        else:
            fill("scheduler.params.warmup_max_lr", hp.lr, "lr")
        warmup = None if hp.warmup_steps is None else max(1, hp.warmup_steps)  # HF: max(1, ...)
        fill("scheduler.params.warmup_num_steps", warmup, "warmup_steps")
        fill("scheduler.params.total_num_steps", hp.total_steps, "total_steps")
    elif sched is None and hp.warmup_steps:
        log.warning(
            "warmup_steps=%d was given but the config has no scheduler section: the lr stays constant; "
            "add a scheduler (e.g. WarmupLR) to warm up",
            hp.warmup_steps,
        )

    # --- batch, clipping, precision ---------------------------------------------------------
    fill("train_micro_batch_size_per_gpu", hp.micro_batch_size, "micro_batch_size", insert=True)
    fill(
        "gradient_accumulation_steps",
        hp.gradient_accumulation_steps,
        "gradient_accumulation_steps",
        insert=True,
    )
    fill("gradient_clipping", hp.max_grad_norm, "max_grad_norm", insert=True)
    precision = hp.mixed_precision
    if precision == "fp16" and cfg.get("fp16") is None:
        cfg["fp16"] = {"enabled": True}  # the caller asked for it; the file has no section to fill
    if precision == "bf16" and cfg.get("bf16") is None and cfg.get("bfloat16") is None:
        cfg["bf16"] = {"enabled": True}
    fill(
        "fp16.enabled",
        None if precision is None else precision == "fp16",
        "mixed_precision",
        insert=True,
        shown=precision,
    )
    for key in ("bf16", "bfloat16"):
        fill(
            f"{key}.enabled",
            None if precision is None else precision == "bf16",
            "mixed_precision",
            insert=True,
            shown=precision,
        )
    if mismatches:
        raise ConfigError(
            "the config contradicts the caller's hyper-parameters (as Hugging Face's Trainer, tiered "
            "refuses rather than pick one): "
            + "; ".join(mismatches)
            + ". Set the key to \"auto\" to take the caller's value, or pass the config's value"
        )
    return cfg, tuple(dict.fromkeys(unset))


def check_complete(unset: tuple[str, ...], *, flags: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError if any key is unset, naming each key and what supplies it.

    `flags` maps a keyword to the command-line flag that supplies it (`tiered finetune`)."""
    if not unset:
        return
    flags = flags or {}
    lines = []
    for path in unset:
        keyword = KEYWORD_OF.get(path, "")
        via = f"pass {keyword}= to tiered.initialize" if keyword else "write a value"
        if keyword in flags:
            via = f"pass {flags[keyword]}"
        if path == "optimizer":
            lines.append(
                f"the config has no optimizer section, so no learning rate: {via} (and weight_decay=, "
                'betas=, eps= as your trainer would), or add "optimizer": {"type": "AdamW", '
                '"params": {"lr": ...}}'
            )
        elif path == "scheduler.params.total_num_steps":
            lines.append(f'{path} is "auto": {via} (the number of optimizer steps), or write a number')
        else:
            lines.append(
                f'{path} is "auto" or missing and nobody supplied it: {via}, or write a value in the config'
            )
    raise ConfigError("tiered never invents a hyper-parameter; " + "; ".join(lines))
