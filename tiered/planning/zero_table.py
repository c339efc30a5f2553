"""The ZeRO paper's model-state bytes per rank: an explanatory view `tiered plan` prints.

[Note: the ZeRO paper's table]
Before the configs it weighs, `tiered plan` shows the paper's model-state bytes per rank for
data parallel and ZeRO-1/2/3 (Rajbhandari et al., Figure 1; docs/architecture.md, "Memory
model"). Ψ parameters, N ranks, p / g bytes per parameter / gradient, K(Ψ) bytes of optimizer
state for Ψ parameters:

    DP (p + g)Ψ + K(Ψ);  ZeRO-1 (p + g)Ψ + K(Ψ)/N;  ZeRO-2 pΨ + (gΨ + K(Ψ))/N;  ZeRO-3 (pΨ + gΨ + K(Ψ))/N

It decides nothing; it says why a model needs ZeRO-3 or offload. Its bytes per parameter come
from the code the engine sizes its partitions with, for the plan's base config: p = g = the
compute dtype's size (the gradient as backward makes it), K(Ψ) = the Adam state of
``tiered.optimizer_state_format`` (`StateFormat.state_bytes`: 12 B per parameter for fp32
state, the fp32 master included), less the master where the parameter is fp32 (it is its own
master: 4 + 4 + 8). LoRA's frozen parameters count p bytes each, sharded under ZeRO-3.
Communication per step per rank at the paper's level: DP..ZeRO-2 move 2Ψ elements of g bytes
(one all-reduce), ZeRO-3 3Ψ of p bytes (1.5x), nothing on one rank.

What the paper leaves out (the gathered working set, activations, tiered's fp32 gradient
partitions, staging buffers, the process itself) and every offloaded placement are counted by the
engine's own memory model ([Note: one memory model]) in the search ([Note: config search]): the
plan's offloaded rows are the search's candidates, never formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tiered.config.schema import TieredConfig
from tiered.optim.state_format import FORMATS

STRATEGIES = (("dp", "DP", 0), ("zero1", "ZeRO-1", 1), ("zero2", "ZeRO-2", 2), ("zero3", "ZeRO-3", 3))


@dataclass(frozen=True)
class PaperBytes:
    """p, g and K of [Note: the ZeRO paper's table] for one config."""

    param: int
    grad: int
    state_format: str
    master_is_param: bool

    @staticmethod
    def of(cfg: TieredConfig) -> PaperBytes:
        size = cfg.precision.dtype.itemsize
        fp32 = cfg.precision.dtype == torch.float32
        return PaperBytes(size, size, cfg.tiered.optimizer_state_format, fp32)

    def optimizer(self, psi: int) -> int:
        """K(Ψ): the Adam state of `psi` parameters."""
        state = FORMATS[self.state_format].state_bytes(psi)
        return state - 4 * psi if self.master_is_param else state

    def per_param(self) -> dict[str, float]:
        k = self.optimizer(10**9) / 10**9
        return {"param": self.param, "grad": self.grad, "optimizer": int(k) if k == int(k) else k}


def _shard(total: int, n: int) -> int:
    return -(-total // n)  # a rank holds the ceiling of its share: shards are padded to equal size


def model_state_bytes(stage: int, psi: int, n: int, b: PaperBytes) -> int:
    """GPU bytes per rank of the model states at ZeRO `stage` (0 = DP), the paper's formula."""
    p, g, k = b.param * psi, b.grad * psi, b.optimizer(psi)
    return (p + g + k, p + g + _shard(k, n), p + _shard(g + k, n), _shard(p + g + k, n))[stage]


@dataclass(frozen=True)
class PaperRow:
    """One row of the table: the model-state bytes per rank, itemised, and the communication."""

    key: str
    name: str
    stage: int
    terms: tuple[tuple[str, int], ...]
    """(what, bytes), all on the GPU."""
    comm_bytes_per_step: int

    @property
    def gpu_bytes(self) -> int:
        return sum(b for _, b in self.terms)

    def shortfall(self, gpu: int | None) -> int:
        """Bytes beyond the GPU memory given (0 when it fits or none was given)."""
        return 0 if gpu is None else max(0, self.gpu_bytes - gpu)

    def to_json(self, gpu: int | None) -> dict[str, Any]:
        short = self.shortfall(gpu)
        return {
            "key": self.key,
            "name": self.name,
            "stage": self.stage,
            "terms": [{"tier": "gpu", "what": w, "bytes": b} for w, b in self.terms],
            "gpu_model_state_bytes": self.gpu_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "shortfall_bytes": {"gpu": short} if short else {},
            "fits": None if gpu is None else not short,
        }


def zero_table(psi: int, n: int, b: PaperBytes, *, trainable: int | None = None) -> tuple[PaperRow, ...]:
    """DP and ZeRO-1/2/3 for `psi` parameters on `n` ranks; `trainable` of them get gradients
    and optimizer state (None: all), the others are frozen ([Note: the ZeRO paper's table])."""
    psi_t = psi if trainable is None else trainable
    rows = []
    for key, name, stage in STRATEGIES:
        terms = [("model states (ZeRO formula)", model_state_bytes(stage, psi_t, n, b))]
        if psi_t < psi:
            frozen = (psi - psi_t) * b.param
            terms.append(
                (
                    "frozen parameters (no gradient or optimizer state)",
                    _shard(frozen, n) if stage == 3 else frozen,
                )
            )
        comm = 0 if n == 1 else (3 * psi * b.param if stage == 3 else 2 * psi * b.grad)
        rows.append(PaperRow(key, name, stage, tuple(terms), comm))
    return tuple(rows)


def gb(n: int | float) -> float:
    """Bytes to GB (1e9), one decimal, as the plan prints them."""
    return math.floor(n / 1e8 + 0.5) / 10
