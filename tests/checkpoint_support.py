"""Helpers for the checkpoint tests: a training loop, and the state a bit-exact resume must equal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from engine_support import Batch, Case

from tiered.checkpoint.partition_io import resident


def train(engine: Any, case: Case, batches: Sequence[Batch]) -> list[float]:
    losses = []
    for b in batches:
        loss = case.loss(engine(**b))
        losses.append(float(loss.detach().float()))
        engine.backward(loss)
        engine.step()
    return losses


def full_state(engine: Any) -> dict[str, Any]:
    """Everything a resume must restore, as host copies: parameters (consolidated, compute
    dtype), every group's master / exp_avg / exp_avg_sq shard, counters, loss scale, lr."""
    params = {k: v.detach().clone() for k, v in engine.zero.gather_full_state_dict().items()}
    opt = {}
    for gname, parts in engine.optimizer.checkpoint_partitions().items():
        for kind, part in parts.items():
            tiles = []
            for p in part if isinstance(part, tuple) else (part,):  # a group stepped in tiles
                with resident(engine.tm, p) as t:
                    tiles.append(t.detach().to("cpu", copy=True))
            opt[f"{gname}.{kind}"] = torch.cat(tiles)
    return {
        "params": params,
        "opt": opt,
        "counters": (
            engine.global_steps,
            engine.micro_steps,
            engine.skipped_steps,
            engine.optimizer.step_count,
        ),
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr": engine.get_lr(),
    }


def assert_bitwise_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["counters"] == want["counters"]
    assert got["loss_scaler"] == want["loss_scaler"]
    assert got["lr"] == want["lr"]
    for section in ("params", "opt"):
        assert set(got[section]) == set(want[section])
        for k, v in want[section].items():
            g = got[section][k]
            assert g.dtype == v.dtype and torch.equal(
                g.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)
            ), (
                f"{section} {k} differs after resume (max abs {float((g.float() - v.float()).abs().max()):.3g})"
            )
