"""Models in which some parameters get no gradient on some steps (issue: PyTorch's rule that such a
parameter is not stepped), and their batches. Per-sample routing, so that splitting a batch over
ranks changes which rank uses a parameter but not the global result."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from engine_support import Batch, Case

D = 8


class TopOneMoE(nn.Module):
    """An nn.ModuleList of 8 experts, top-1 routing per token: experts no token chose get no grad.
    `route` (given by the data, as hash routing does) replaces the learned choice."""

    def __init__(self, n_experts: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, n_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(n_experts)
        )
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        x, y = x.to(self.inp.weight.dtype), y.to(self.inp.weight.dtype)  # (bf16 / fp16 runs)
        h = torch.tanh(self.inp(x))
        probs = F.softmax(self.router(h), dim=-1)
        gate, choice = probs.max(dim=-1)
        if route is not None:
            choice = route
            gate = probs.gather(1, route[:, None]).reshape(-1)
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == k).reshape(-1)
            if idx.numel():
                out = out.index_add(0, idx, expert(h[idx]) * gate[idx, None])
        return F.mse_loss(self.head(h + out), y, reduction="sum") / x.shape[0]


class SampleBranch(nn.Module):
    """Samples with x[:, 0] > 0 go through `left`, the others through `right`: a batch of one kind
    skips the other submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.left = nn.Linear(D, D)
        self.right = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        pos = torch.nonzero(x[:, 0] > 0).reshape(-1)
        neg = torch.nonzero(x[:, 0] <= 0).reshape(-1)
        out = torch.zeros_like(h)
        if pos.numel():
            out = out.index_add(0, pos, self.left(h[pos]))
        if neg.numel():
            out = out.index_add(0, neg, self.right(h[neg]))
        return F.mse_loss(self.head(out), y, reduction="sum") / x.shape[0]


class HeadWithAux(nn.Module):
    """A head whose extra weight only serves flagged samples: one module (gathered on every rank
    alike), one of whose parameters gets a gradient only where a flagged sample is."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, 4)
        self.aux = nn.Parameter(torch.randn(D, 4) / D)

    def forward(self, h: torch.Tensor, flagged: torch.Tensor) -> torch.Tensor:
        out = self.proj(h)
        if flagged.numel():
            out = out.index_add(0, flagged, h[flagged] @ self.aux)
        return out


class AuxHead(nn.Module):
    """An auxiliary weight only for samples flagged by x[:, 0] > 0 (rare: one micro-batch of a window)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D))
        self.head = HeadWithAux()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        flagged = torch.nonzero(x[:, 0] > 0).reshape(-1)
        return F.mse_loss(self.head(h, flagged), y, reduction="sum") / x.shape[0]


def _batch(g: torch.Generator, n: int) -> Batch:
    return {"x": torch.randn(n, D, generator=g), "y": torch.randn(n, 4, generator=g)}


CASES = {
    "moe": Case("moe", TopOneMoE, _batch, lambda out: out),
    "branch": Case("branch", SampleBranch, _batch, lambda out: out),
    "aux": Case("aux", AuxHead, _batch, lambda out: out),
}


def make_batches(
    name: str, steps: int, micro: int, gas: int = 1, seed: int = 3, *, ranks: int = 1
) -> list[Batch]:
    """moe: few tokens (micro) over 8 experts, so some experts idle each step (with ranks > 1,
    hash-routed: each rank's part of the batch calls the same experts, as ZeRO-3 gathers need).
    branch: all samples of a step on one side on even steps (the other submodule skipped),
    alternating on odd ones. aux: one flagged sample per rank only in the first micro-batch of
    even windows (none in odd windows). (Every rank uses the same parameters in a step here;
    ranks that use different ones, with a leaf module declared: tests/test_leaf_modules_dist.py.)"""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps * gas):
        b = _batch(g, micro)
        step, micro_i = divmod(i, gas)
        x0 = b["x"][:, 0]
        if name == "moe" and ranks > 1:
            experts = torch.tensor([step % 8, (step + 3) % 8])
            b["route"] = experts[torch.arange(micro) % 2]
        elif name == "branch":
            if step % 2 == 0:
                b["x"][:, 0] = x0.abs() if step % 4 == 0 else -x0.abs()
            else:
                b["x"][:, 0] = x0.abs() * (1 - 2 * (torch.arange(micro) % 2))
        elif name == "aux":
            b["x"][:, 0] = -x0.abs()
            if step % 2 == 0 and micro_i == 0:
                b["x"][:: micro // ranks, 0] = 1.0  # one flagged sample per rank's part
        out.append(b)
    return out
