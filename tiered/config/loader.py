"""`load_config`: a tiered or DeepSpeed JSON (dict, JSON text file) -> resolved `TieredConfig`.

The one place raw configuration is parsed. Every key is classified ([Note: key classification]
in keys.py); "auto" sizes are resolved from the model ([Note: auto from the model]); "auto"
hyper-parameters come from the caller or stay unset ([Note: caller-supplied hyper-parameters]
in hyper.py): tiered never invents one. Consistency is checked the way DeepSpeed checks it, with
errors that name the keys.

[Note: config parsing is pure]
Parsing reads the config and checks it, and writes nothing: no folder, no file. A path the run
will write (``nvme_path``) is checked as far as it can be without creating it (a directory, or
creatable under a writable one), and the backend that opens it creates it, once
(``"create": true`` in the nvme tier derived from it, tiered/config/tiers.py). So a config may be
parsed as often as a caller likes (the planner parses every candidate it weighs), and one that is
refused, or that puts nothing on NVMe, leaves nothing behind to clean up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from tiered.config.dump import dump_config
from tiered.config.hyper import Hyperparameters, apply_hyperparameters, check_complete
from tiered.config.keys import check_section
from tiered.config.read import read_key
from tiered.config.scheduler import normalize_scheduler, scheduler_type
from tiered.config.schema import SchedulerConfig, TieredConfig
from tiered.config.sections import parse_aio, parse_optimizer, parse_precision, parse_zero
from tiered.config.tiers import parse_tiered
from tiered.config.user_files import check_depth as nested_check
from tiered.config.user_files import parse_json_text, read_user_file
from tiered.config.values import AUTO, as_choice, as_count, as_section, is_auto
from tiered.errors import ConfigError, UnsupportedConfigError

log = logging.getLogger(__name__)

# steps_per_print "auto" is not a hyper-parameter: DeepSpeed's default. Other "auto" counts here
# are unset (TieredConfig.unset) and hold placeholders nothing reads: None, and 0.0 for clipping.
_COMM_DTYPES = ("fp32", "fp16", "bf16")


CONFIG_MAX_BYTES = 16 << 20
"""The largest config file read: DeepSpeed's are a few kilobytes ([Note: files a user names])."""


def read_config_file(path: str | os.PathLike[str], what: str = "config file") -> dict[str, Any]:
    """Parse a JSON config file; a syntax error names the file, line and column. Only a regular
    file of at most `CONFIG_MAX_BYTES` is read ([Note: files a user names]). `what` names the
    file in errors as the user gave it (a flag such as "--config")."""
    name = os.fspath(path)
    where = f"{what} {name!r}"

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # json.loads keeps the last of two equal keys; a silently dropped setting is worse than an error.
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"{where}: key {key!r} appears twice in one object; keep one")
            out[key] = value
        return out

    if not os.path.lexists(name):
        raise ConfigError(f"{where} does not exist; pass a JSON file path or a dict")
    text = read_user_file(name, what, CONFIG_MAX_BYTES, hint="pass a JSON config file")
    data = parse_json_text(text, where, max_depth=MAX_DEPTH, object_pairs_hook=no_duplicates)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a JSON object {{...}}")
    return data


def _check_state_format_optimizer(config: dict[str, Any]) -> None:
    """A compressed tiered.optimizer_state_format stores Adam's moments: with another optimizer
    it is refused by name before the optimizer section is parsed (which refuses it generically)."""
    section = config.get("tiered")
    fmt = section.get("optimizer_state_format") if isinstance(section, dict) else None
    opt = config.get("optimizer")
    kind = opt.get("type") if isinstance(opt, dict) else None
    if fmt in (None, "fp32") or not isinstance(kind, str):
        return
    if kind.strip().lower() not in ("adam", "adamw"):
        raise UnsupportedConfigError(
            f"tiered.optimizer_state_format = {fmt!r} compresses Adam's exp_avg and exp_avg_sq, but "
            f"optimizer.type is {kind!r}; use Adam or AdamW, or tiered.optimizer_state_format 'fp32'"
        )


MAX_DEPTH = 64
"""How deep a config may nest: DeepSpeed's are 4 levels at most, a backend spec adds a few."""


def check_depth(config: dict[str, Any], source: str = "config") -> None:
    """ConfigError naming the first path nested deeper than `MAX_DEPTH` ([Note: files a user names])."""
    nested_check(config, source, MAX_DEPTH)


def load_config(
    source: dict[str, Any] | str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    world_size: int = 1,
    hyperparameters: Hyperparameters | None = None,
) -> TieredConfig:
    """Resolve a tiered or DeepSpeed config (a dict, or the path of a JSON file).

    `model` resolves the model-dependent "auto" sizes; `world_size` (data-parallel ranks) enters
    the batch-size identity train_batch_size = micro * gradient_accumulation_steps * world_size.
    `hyperparameters` are the caller's (a trainer's) values for "auto" and missing keys; what
    neither gives is listed in `TieredConfig.unset` (see hyper.py). Raises ConfigError
    (UnsupportedConfigError for recognised-but-unsupported features) naming the key path and what
    to do.
    """
    if isinstance(source, (str, os.PathLike)):
        config = read_config_file(source)
    elif isinstance(source, dict):
        config = source
    else:
        raise ConfigError(f"load_config: expected a dict or a JSON file path, got {type(source).__name__}")
    check_depth(config)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"load_config: world_size must be a positive int, got {world_size!r}")

    config, unset = apply_hyperparameters(config, hyperparameters or Hyperparameters())
    check_section(config, "")
    zero = parse_zero(config.get("zero_optimization"), model)
    aio = parse_aio(config.get("aio"))
    _check_state_format_optimizer(config)
    optimizer = parse_optimizer(config.get("optimizer"))
    lr_unset = "optimizer" in unset or "optimizer.params.lr" in unset
    precision = parse_precision(config)
    tiered, overlap_step = parse_tiered(config.get("tiered"), zero, aio)
    zero = dataclasses.replace(zero, overlap_step_with_backward=overlap_step)
    for name in ("checkpoint", "data_types", "compile", "tensor_parallel"):
        if config.get(name) is not None:
            check_section(as_section(config[name], name), name)
    tp = config.get("tensor_parallel")
    for name in ("tp", "tensor_parallel"):  # DeepSpeed's TPConfig, under either spelling
        if isinstance(tp, dict) and tp.get(name) is not None:
            check_section(as_section(tp[name], f"tensor_parallel.{name}"), f"tensor_parallel.{name}")

    scheduler = None
    if config.get("scheduler") is not None:
        raw = as_section(config["scheduler"], "scheduler")
        check_section(raw, "scheduler")
        if "type" not in raw:
            raise ConfigError("scheduler.type is missing; use WarmupLR, WarmupDecayLR or WarmupCosineLR")
        params = normalize_scheduler(
            raw["type"], raw.get("params"), base_lr=None if lr_unset else optimizer.lr
        )
        scheduler = SchedulerConfig(type=scheduler_type(raw["type"]), params=params)
        if params.get("warmup_max_lr") == AUTO:
            unset = (*unset, "scheduler.params.warmup_max_lr")

    train_batch, micro, gas = _batch_sizes(config, world_size)
    return TieredConfig(
        zero=zero,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        aio=aio,
        tiered=tiered,
        gradient_accumulation_steps=gas,
        gradient_clipping=read_key(
            config, TieredConfig, "gradient_clipping"
        ),  # "auto": unset, 0.0 placeholder
        train_batch_size=train_batch,
        train_micro_batch_size_per_gpu=micro,
        steps_per_print=read_key(config, TieredConfig, "steps_per_print"),
        wall_clock_breakdown=read_key(config, TieredConfig, "wall_clock_breakdown"),
        dataloader_drop_last=read_key(config, TieredConfig, "dataloader_drop_last"),
        communication_data_type=(
            None
            if config.get("communication_data_type") is None
            else as_choice(config["communication_data_type"], "communication_data_type", _COMM_DTYPES)
        ),
        unset=unset,
    )


def _count_key(config: dict[str, Any], key: str) -> int | None:
    """train_micro_batch_size_per_gpu / gradient_accumulation_steps: None when absent or "auto"
    (then derived by the batch rules, or unset)."""
    value = config.get(key)
    if value is None or is_auto(value):
        return None
    return as_count(value, key, minimum=1)


def _batch_sizes(config: dict[str, Any], world_size: int) -> tuple[int | None, int | None, int]:
    """DeepSpeed's batch rules (runtime/config.py `_set_batch_related_parameters`), with "auto".

    Given two of (train_batch_size, micro, gas) the third is derived; given all three they must
    satisfy train = micro * gas * world_size. Unlike DeepSpeed, giving none is allowed: tiered's
    engine does not need batch sizes (you feed it micro-batches), so they stay None and gas is 1.
    """
    micro = _count_key(config, "train_micro_batch_size_per_gpu")
    gas = _count_key(config, "gradient_accumulation_steps")
    train_raw = config.get("train_batch_size")
    if train_raw is not None and is_auto(train_raw):
        # derived, as HF derives it, once micro and gas are known; else left to them (unset)
        micro_known = micro is not None and not is_auto(config.get("train_micro_batch_size_per_gpu"))
        gas = 1 if gas is None else gas
        return (micro * gas * world_size if micro_known and micro is not None else None), micro, gas
    train = None if train_raw is None else as_count(train_raw, "train_batch_size", minimum=1)
    ws = f"world_size ({world_size})"
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            raise ConfigError(
                f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({gas}) * {ws} = {micro * gas * world_size}; "
                "fix one of them or drop train_batch_size to have it derived"
            )
    elif train is not None and micro is not None:
        gas, rem = divmod(train, micro * world_size)
        if rem or gas < 1:
            raise ConfigError(
                f"train_batch_size ({train}) is not a multiple of train_micro_batch_size_per_gpu ({micro}) * {ws}; "
                "gradient_accumulation_steps cannot be derived: fix the sizes or give it explicitly"
            )
    elif train is not None and gas is not None:
        micro, rem = divmod(train, gas * world_size)
        if rem or micro < 1:
            raise ConfigError(
                f"train_batch_size ({train}) is not a multiple of gradient_accumulation_steps ({gas}) * {ws}; "
                "train_micro_batch_size_per_gpu cannot be derived: fix the sizes or give it explicitly"
            )
    elif train is not None:
        gas = 1
        micro, rem = divmod(train, world_size)
        if rem or micro < 1:
            raise ConfigError(
                f"train_batch_size ({train}) is not a multiple of {ws}; set train_micro_batch_size_per_gpu"
            )
    elif micro is not None:
        gas = 1 if gas is None else gas
        train = micro * gas * world_size
    return train, micro, (1 if gas is None else gas)


def config_for_training(
    config: dict[str, Any] | str | os.PathLike[str] | TieredConfig,
    *,
    model: torch.nn.Module | None,
    world_size: int = 1,
    **hyperparameters: Any,
) -> TieredConfig:
    """What `tiered.initialize` trains with: the config resolved with the caller's keywords
    (lr=, betas=, eps=, weight_decay=, warmup_steps=, total_steps=, micro_batch_size=,
    gradient_accumulation_steps=, max_grad_norm=, mixed_precision=), refused with a ConfigError
    naming each key nobody supplied ([Note: caller-supplied hyper-parameters])."""
    valid = [f.name for f in dataclasses.fields(Hyperparameters)]
    unknown = sorted(set(hyperparameters) - set(valid))
    if unknown:
        raise TypeError(
            f"tiered.initialize: unknown keyword {', '.join(unknown)}; hyper-parameter keywords: "
            f"{', '.join(valid)}"
        )
    hp = Hyperparameters(**hyperparameters)
    if isinstance(config, TieredConfig):
        if not hp.given():
            check_complete(config.unset)
            return config
        config = dump_config(config)  # unset keys come back as "auto" for the keywords to fill
    cfg = load_config(config, model=model, world_size=world_size, hyperparameters=hp)
    check_complete(cfg.unset)
    return cfg
