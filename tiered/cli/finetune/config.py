"""`tiered finetune`'s config: the command line applied to the config file, the hyper-parameters
it supplies, and the refusals of what nobody supplied, named as a command-line user fixes them."""

from __future__ import annotations

import copy
import difflib
import logging
from typing import Any

from tiered.cli.finetune.options import FinetuneOptions
from tiered.errors import ConfigError

log = logging.getLogger(__name__)


def with_auto_config(raw: dict[str, Any], spec: str) -> dict[str, Any]:
    """`raw` with ``tiered.auto_config`` from ``--auto-config key=value,...``: each key once, at
    least one (an empty spec would plan for no memory at all)."""
    from tiered.config.auto_request import AUTO_KEYS

    auto: dict[str, str] = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or key not in AUTO_KEYS:
            near = difflib.get_close_matches(key, AUTO_KEYS, n=1)
            raise ConfigError(
                f"--auto-config: cannot read {part!r}; write key=value pairs, keys {', '.join(AUTO_KEYS)} "
                f"(e.g. cpu_mem=64GB,gpu_mem=80GB){f'; did you mean {near[0]}?' if near and eq else ''}"
            )
        if key in auto:
            raise ConfigError(
                f"--auto-config: {key} is given twice ({key}={auto[key]} and {key}={value}); keep one"
            )
        if not value:
            raise ConfigError(f"--auto-config: {key} has no value; write e.g. {key}=64GB")
        auto[key] = value
    if not auto:
        raise ConfigError(
            f"--auto-config: {spec!r} holds no key=value pair; give the memories to plan for, e.g. "
            "cpu_mem=64GB,gpu_mem=80GB (or leave --auto-config out)"
        )
    tiered_section = dict(raw.get("tiered") or {})
    tiered_section["auto_config"] = auto
    return {**raw, "tiered": tiered_section}


def load_checked(
    o: FinetuneOptions, raw: dict[str, Any], hp: Any, model: Any, hf: Any
) -> tuple[Any, int, Any]:
    """(config, micro-batch, activation estimate), refused before anything is printed as if it
    were chosen (and before anything is written: [Note: config parsing is pure])."""
    import torch

    from tiered.config.loader import load_config
    from tiered.finetune.activations import check_activations, estimate_activations
    from tiered.finetune.loop import micro_batch_size

    if o.auto_config is not None and o.config is not None:  # without one: in the machine's (machine.py)
        raw = with_auto_config(raw, o.auto_config)
    from tiered.config.auto_request import CONFIG_SPELLING, has_auto_config
    from tiered.planning.auto import resolve_auto_config

    if has_auto_config(raw):  # [Note: auto config]: chosen over the model being trained
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        raw = resolve_auto_config(
            raw,
            model,
            world_size=world,
            spelled="--auto-config " if o.auto_config is not None or o.config is None else CONFIG_SPELLING,
            activations=lambda cfg: _activation_estimate(cfg, o, hf),
        )
    cfg = load_config(raw, model=model, hyperparameters=hp)
    check_complete_for_cli(cfg.unset, o.config_name)
    micro = micro_batch_size(cfg, o.batch_size)
    if o.compare_torch and cfg.precision.dtype != torch.float32:
        raise ConfigError(
            f"--compare-torch compares fp32 runs only, but {o.config_name} enables bf16/fp16; drop "
            "--compare-torch or the bf16/fp16 section"
        )
    act = estimate_activations(
        hf,
        batch=micro,
        seq_len=o.seq_len,
        dtype=cfg.precision.dtype,
        checkpointing=o.gradient_checkpointing,
        compute_on_cpu=not torch.cuda.is_available(),
    )
    check_activations(act, torch.device("cuda" if torch.cuda.is_available() else "cpu"), o.free_memory)
    return cfg, micro, act


def _activation_estimate(cfg: Any, o: FinetuneOptions, hf: Any) -> int:
    """``auto_config``'s ``activation_mem`` where the config leaves it out: [Note: activation
    estimate] for this run's micro-batch, sequence length, precision and checkpointing, read from
    the validated config `cfg`, so the search leaves the activations their room (on a CPU-only
    machine, in host memory: [Note: compute memory on a CPU-only machine])."""
    import torch

    from tiered.finetune.activations import estimate_activations

    given = cfg.train_micro_batch_size_per_gpu
    micro = o.batch_size if o.batch_size is not None else (given or 1)
    est = estimate_activations(
        hf,
        batch=micro,
        seq_len=o.seq_len,
        dtype=cfg.precision.dtype,
        checkpointing=o.gradient_checkpointing,
        compute_on_cpu=not torch.cuda.is_available(),
    )
    log.info("tiered.auto_config: activation_mem from the estimate: %s", est.describe())
    return int(est.total_bytes)


# The flag that supplies each hyper-parameter keyword (for "tiered never invents" errors).
_FLAGS = {
    "lr": "--lr",
    "weight_decay": "--weight-decay",
    "warmup_steps": "--warmup-steps",
    "total_steps": "--steps",
    "micro_batch_size": "--batch-size",
}
# What a config key with no flag could hold: the refusal shows it as the fix.
_JSON_EXAMPLES = {
    "optimizer.params.betas": "[0.9, 0.999]",
    "optimizer.params.eps": "1e-8",
    "gradient_accumulation_steps": "1",
    "gradient_clipping": "1.0",
    "fp16.enabled": "false",
    "bf16.enabled": "false",
}


def check_complete_for_cli(unset: tuple[str, ...], config_name: str) -> None:
    """`tiered finetune`'s form of config.hyper.check_complete: every "auto" or missing
    hyper-parameter named with what a command-line user can do about it, the flag that exists
    or the JSON key to write (never tiered.initialize's keywords, which this command has not)."""
    from tiered.config.hyper import KEYWORD_OF

    if not unset:
        return
    lines = []
    for path in unset:
        flag = _FLAGS.get(KEYWORD_OF.get(path, ""))
        if path == "optimizer":
            lines.append(
                f"{config_name} has no optimizer section, so no learning rate: pass --lr (and "
                '--weight-decay as your trainer would), or add "optimizer": {"type": "AdamW", "params": '
                '{"lr": ...}}'
            )
        elif flag is not None:
            lines.append(f'{path} is "auto" or missing in {config_name}: pass {flag}, or write a value there')
        else:
            example = _JSON_EXAMPLES.get(path)
            lines.append(
                f'{path} is "auto" or missing in {config_name} and tiered finetune has no flag for it: '
                f"write a value there{f' (e.g. {example})' if example else ''}"
            )
    raise ConfigError("tiered never invents a hyper-parameter; " + "; ".join(lines))


def hyperparameter_flags(
    raw: dict[str, Any], *, weight_decay: float | None, warmup_steps: int | None, steps: int
) -> tuple[dict[str, Any], Any]:
    """Apply --weight-decay / --warmup-steps like --lr (they override a value the config gives),
    and --steps as total_num_steps where the config says "auto"; what the config leaves out goes
    to load_config as the caller's values ([Note: caller-supplied hyper-parameters])."""
    from tiered.config.hyper import Hyperparameters
    from tiered.config.values import is_auto

    raw = copy.deepcopy(raw)
    opt, sched = raw.get("optimizer"), raw.get("scheduler")
    opt_params = opt.get("params") if isinstance(opt, dict) else None
    sched_params = sched.get("params") if isinstance(sched, dict) else None
    if weight_decay is not None and isinstance(opt_params, dict):
        opt_params["weight_decay"] = weight_decay
        weight_decay = None
    if warmup_steps is not None and isinstance(sched_params, dict):
        sched_params["warmup_num_steps"] = max(1, warmup_steps)
        warmup_steps = None
    total = sched_params.get("total_num_steps") if isinstance(sched_params, dict) else None
    try:
        hp = Hyperparameters(
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            total_steps=steps if total is not None and is_auto(total) else None,
        )
    except ConfigError as exc:
        raise ConfigError(
            str(exc).replace("weight_decay=", "--weight-decay").replace("warmup_steps=", "--warmup-steps")
        ) from None
    return raw, hp
