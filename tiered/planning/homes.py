"""Which tier is home to each kind of state: decided once from the resolved config, by the
engine at initialize and by the planner for every config it weighs (the same function)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered.config.schema import TieredConfig
from tiered.errors import ConfigError

_DEVICE_TIER = {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}


@dataclass(frozen=True)
class Placement:
    """Which tier is home to each kind of state, and the compute dtype."""

    param_tier: str
    grad_tier: str
    optimizer_tier: str
    compute_dtype: torch.dtype

    def describe(self, cfg: TieredConfig) -> str:
        """ "params in nvme (nvme), gradients in cpu (cpu), optimizer state in mine (dirstore)":
        the tiers really used and the backend type behind each."""

        def tier(name: str) -> str:
            spec = cfg.tiered.tiers.get(name)
            kind = spec.backend.get("type") if spec is not None else None
            return f"{name} ({kind})" if kind not in (None, name) else name

        return (
            f"params in {tier(self.param_tier)}, gradients in {tier(self.grad_tier)}, "
            f"optimizer state in {tier(self.optimizer_tier)}"
        )


def choose_placement(cfg: TieredConfig) -> Placement:
    tiers = cfg.tiered.tiers
    opt_dev = cfg.zero.offload_optimizer.device
    # tiered.param_tier / optimizer_tier (a custom tier, e.g. a tensorstore backend) or the tier
    # the offload device derives; None when that offload is off
    opt_tier = cfg.tiered.optimizer_tier or _DEVICE_TIER[opt_dev]
    if opt_dev == "nvme" and "nvme_optimizer" in tiers and cfg.tiered.optimizer_tier in (None, "nvme"):
        opt_tier = "nvme_optimizer"
    placement = Placement(
        param_tier=cfg.tiered.param_tier or _DEVICE_TIER[cfg.zero.offload_param.device],
        grad_tier="gpu" if opt_dev == "none" else (cfg.tiered.grad_tier or "cpu"),
        optimizer_tier=opt_tier,
        compute_dtype=cfg.precision.dtype,
    )
    for what, tier, key in (
        ("parameters", placement.param_tier, "zero_optimization.offload_param.device"),
        ("optimizer state", placement.optimizer_tier, "zero_optimization.offload_optimizer.device"),
    ):
        if tiers and tier not in tiers:
            raise ConfigError(
                f"{key} puts the {what} in tier {tier!r}, but no such tier is configured "
                f"(tiers: {', '.join(tiers)}); add it under tiered.tiers.{tier} or set an nvme_path"
            )
    _refuse_unused_tiers(cfg, placement)
    return placement


def _refuse_unused_tiers(cfg: TieredConfig, placement: Placement) -> None:
    """A tier the user declares that no state is routed to would run with 0 reads and 0 writes:
    a config error naming the keys that route offload there, never a silent no-op."""
    from tiered.config.tiers import derived_tier_names
    from tiered.storage.registry import get_backend_class
    from tiered.tiers.tier import check_tier_name

    used = {placement.param_tier, placement.grad_tier, placement.optimizer_tier}
    derived = derived_tier_names(cfg.zero, cfg.aio)
    unused = [n for n in cfg.tiered.tiers if n not in used and n not in derived]
    for n in unused:  # a tier that could not even be opened is reported as that, first
        check_tier_name(n)
        get_backend_class(str(cfg.tiered.tiers[n].backend.get("type", "")))
    if unused:
        name = unused[0]
        raise ConfigError(
            f"tiered.tiers.{name} is declared but nothing is routed to it (parameters go to tier "
            f"{placement.param_tier!r}, optimizer state to {placement.optimizer_tier!r}); set "
            f'"tiered": {{"param_tier": "{name}"}} (with zero_optimization.offload_param.device) or '
            f'{{"optimizer_tier": "{name}"}} (with zero_optimization.offload_optimizer.device), '
            "or remove the tier" + (f"; unused too: {', '.join(unused[1:])}" if len(unused) > 1 else "")
        )
