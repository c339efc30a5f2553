"""The command line's overrides of a config: ``--lr``, ``--batch-size``, ``--nvme-path``.

They rewrite the raw config (a DeepSpeed or tiered dict) before it is parsed, so the parsed config
is the one the user's file plus the flags describe, and `load_config` sees nothing special about
them. Pure: a copy is returned, the caller's dict and the disk are untouched ([Note: config
parsing is pure] in loader.py).
"""

from __future__ import annotations

import copy
from typing import Any

from tiered.errors import ConfigError


def apply_overrides(
    config: dict[str, Any],
    *,
    lr: float | None = None,
    batch_size: int | None = None,
    nvme_path: str | None = None,
) -> dict[str, Any]:
    """A copy of a (DeepSpeed or tiered) config dict with the command line's overrides applied."""
    cfg = copy.deepcopy(config)
    if lr is not None:
        if not lr > 0:
            raise ConfigError(f"--lr must be > 0, got {lr}")
        opt = cfg.setdefault("optimizer", {"type": "AdamW"})
        if not isinstance(opt, dict):
            raise ConfigError('optimizer must be a JSON object with "type" and "params"')
        params = opt.setdefault("params", {})
        if not isinstance(params, dict):
            raise ConfigError("optimizer.params must be a JSON object")
        params["lr"] = lr
    if batch_size is not None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
        cfg["train_micro_batch_size_per_gpu"] = batch_size
        # Keep DeepSpeed's identity train = micro * gas * world true: rederive it from gas.
        if "train_batch_size" in cfg:
            gas = cfg.get("gradient_accumulation_steps")
            if isinstance(gas, int) and not isinstance(gas, bool):
                cfg["train_batch_size"] = batch_size * gas
            else:
                del cfg["train_batch_size"]
    if nvme_path is not None:
        zero = cfg.get("zero_optimization")
        for key in ("offload_param", "offload_optimizer"):
            sec = zero.get(key) if isinstance(zero, dict) else None
            if isinstance(sec, dict) and sec.get("device") == "nvme":
                sec["nvme_path"] = nvme_path
    return cfg
