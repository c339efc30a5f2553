"""`tiered finetune` without ``--config``: the run planned from this machine's memories
([Note: the machine is the default] in tiered/planning/machine.py)."""

from __future__ import annotations

from typing import Any

from tiered.errors import ConfigError

DEFAULT_NVME_PATH = "./tiered_offload"
"""Where NVMe placements write without ``--nvme-path`` (as `tiered plan`'s default)."""


def machine_config(o: Any, world_size: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The raw config of a run without ``--config`` (ZeRO-3, ``tiered.auto_config`` from this
    machine's memories, the user's ``--auto-config`` values over them) and the lines saying what
    was read. The learning rate is never chosen for the user: ``--lr`` is required."""
    import torch

    from tiered.cli.finetune.config import with_auto_config
    from tiered.engine.residency import local_ranks
    from tiered.planning.machine import machine_memories

    if o.lr is None:
        raise ConfigError(
            "--lr is required without --config: tiered plans the memory layout from this machine, but "
            "never chooses a learning rate for you (e.g. --lr 2e-5), or pass --config ds_config.json"
        )
    nvme = str(o.nvme_path or DEFAULT_NVME_PATH)
    machine = machine_memories(nvme, cuda=torch.cuda.is_available(), local_ranks=local_ranks(world_size))
    auto: dict[str, Any] = dict(machine.auto_config())
    if o.auto_config is not None:  # the user's memories over the machine's, key by key
        auto.update(with_auto_config({}, o.auto_config)["tiered"]["auto_config"])
    raw = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"nvme_path": nvme},
            "offload_param": {"nvme_path": nvme},
        },
        "tiered": {"auto_config": auto},
    }
    return raw, machine.said


def describe_machine(said: tuple[str, ...], given: str | None) -> str:
    """The first lines of the block a run without ``--config`` prints: what the machine has."""
    lines = ["no --config: planned from this machine ([Note: the machine is the default]):"]
    lines += [f"  {line}" for line in said]
    if given is not None:
        lines.append(f"  --auto-config {given} (taken over the machine's figures)")
    return "\n".join(lines) + "\n"


def describe_choice(cfg: Any) -> str:
    """The block's last line: what was chosen, and why."""
    from tiered.engine.build import choose_placement

    budgets = ", ".join(
        f"{name} {spec.budget_bytes / 2**30:.2f} GiB"
        for name, spec in cfg.tiered.tiers.items()
        if spec.budget_bytes is not None
    )
    return (
        f"  chosen: {choose_placement(cfg).describe(cfg)}; tier budgets {budgets or 'none'}: the fastest "
        "predicted config of those that fit (tiered plan --model ... shows them all)\n"
    )
