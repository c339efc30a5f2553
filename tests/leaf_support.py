"""Models whose ranks run different parts of the graph (routing, a branch, a weight used by one
rank's micro-batch), their per-rank batches, the DDP ground truth, and a 2-rank launcher that
turns a hang into a test failure. For tests/test_leaf_modules*.py."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from engine_support import Batch, Case
from unused_support import HeadWithAux, TopOneMoE

D = 8
RANKS = 2


class SparseMoE(nn.Module):
    """A router and an nn.ModuleList of experts; each sample goes to the expert `route` names
    (given by the data, as hash routing does), weighted by the router's probability for it."""

    def __init__(self, n_experts: int = 5) -> None:
        super().__init__()
        self.router = nn.Linear(D, n_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(n_experts)
        )

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        gate = F.softmax(self.router(h), dim=-1).gather(1, route[:, None])
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            idx = torch.nonzero(route == k).reshape(-1)
            if idx.numel():
                out = out.index_add(0, idx, expert(h[idx]) * gate[idx])
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = SparseMoE()
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.moe(h, route)
        return F.mse_loss(self.head(h), y, reduction="sum") / x.shape[0]


class Branchy(nn.Module):
    """Takes `left` or `right` for the whole micro-batch, by the sign of the mean of x[:, 0]."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(D, D)
        self.right = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))

    def forward(self, h: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return self.left(h) if bool(x0.mean() > 0) else self.right(h)


class BranchyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = Branchy()
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return F.mse_loss(self.head(self.block(h, x[:, 0])), y, reduction="sum") / x.shape[0]


class AuxNet(nn.Module):
    """`head.aux` serves flagged samples only: the batches flag one sample of one rank's one
    micro-batch in some windows."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D))
        self.head = HeadWithAux()

    def forward(self, x: torch.Tensor, y: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h, torch.nonzero(flag).reshape(-1))
        return F.mse_loss(out, y, reduction="sum") / x.shape[0]


# the experts each rank's micro-batch routes to, per step (expert 4: never)
MOE_ROUTES = [([0, 1, 2], [2, 3]), ([3], [0, 1]), ([1, 2, 3], [1])]
# the branch each rank takes, per step (True: left)
BRANCHES = [(True, False), (False, True), (True, True)]
# (window, micro-batch, rank) whose micro-batch flags one sample; the others flag none
AUX_FLAGS = {(0, 0, 0), (2, 1, 1)}
GAS = {"moe": 1, "branch": 1, "aux": 2, "root": 1}
LEAVES: dict[str, dict[str, list[str]]] = {
    "moe": {"classes": ["SparseMoE"]},
    "branch": {"names": ["block"]},
    "aux": {"name_suffixes": ["head"]},
    "root": {"classes": ["TopOneMoE"]},
}
CASES = {
    "moe": Case("moe", MoENet, lambda g, n: {}, lambda out: out),
    "branch": Case("branch", BranchyNet, lambda g, n: {}, lambda out: out),
    "aux": Case("aux", AuxNet, lambda g, n: {}, lambda out: out),
    "root": Case("root", TopOneMoE, lambda g, n: {}, lambda out: out),
}


def rank_batches(name: str, steps: int = 3, micro: int = 4, seed: int = 5) -> list[list[Batch]]:
    """[rank][micro-step] batches of `micro` samples, as MOE_ROUTES, BRANCHES, AUX_FLAGS say."""
    g = torch.Generator().manual_seed(seed)
    out: list[list[Batch]] = [[] for _ in range(RANKS)]
    for i in range(steps * GAS[name]):
        step, micro_i = divmod(i, GAS[name])
        for r in range(RANKS):
            b = {"x": torch.randn(micro, D, generator=g), "y": torch.randn(micro, 4, generator=g)}
            if name in ("moe", "root"):
                experts = torch.tensor(MOE_ROUTES[step % len(MOE_ROUTES)][r])
                b["route"] = experts[torch.arange(micro) % len(experts)]
            elif name == "branch":
                sign = 1.0 if BRANCHES[step % len(BRANCHES)][r] else -1.0
                b["x"][:, 0] = sign * b["x"][:, 0].abs()
            elif name == "aux":
                b["flag"] = torch.zeros(micro, dtype=torch.bool)
                b["flag"][0] = (step, micro_i, r) in AUX_FLAGS
            out[r].append(b)
    return out


def ddp_reference(
    model: nn.Module,
    case: Case,
    batches: Sequence[Sequence[Batch]],
    *,
    gas: int,
    lr: float,
    weight_decay: float,
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Plain PyTorch as DDP computes it: each rank's loss on its own batch, the gradients
    averaged over the ranks (and the accumulation window), torch.optim.AdamW stepping what any
    rank's micro-batch reached (zero_grad(set_to_none=True)). Returns the losses per rank."""
    model = model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay
    )
    losses: list[list[float]] = [[] for _ in batches]
    for i in range(len(batches[0])):
        for r, mine in enumerate(batches):
            loss = case.loss(model(**mine[i]))
            losses[r].append(float(loss.detach()))
            (loss / (len(batches) * gas)).backward()
        if (i + 1) % gas == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], port: int, out_dir: str, timeout_s: float, args: tuple) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=RANKS,
        timeout=timedelta(seconds=timeout_s),  # a collective nobody joins fails instead of hanging
    )
    try:
        result = fn(rank, *args)
    except Exception:  # noqa: BLE001 (reported to the test, which fails naming it)
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(fn: Callable[..., Any], tmp_path: Path, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """`fn(rank, *args)` on 2 gloo ranks (spawned); its results per rank. A rank that has not
    finished after `timeout_s` (a hang) is killed and the test fails."""
    ctx = mp.start_processes(
        _entry,
        args=(fn, free_port(), str(tmp_path), min(timeout_s, 60.0), args),
        nprocs=RANKS,
        start_method="spawn",
        join=False,
    )
    try:
        import time

        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise AssertionError(f"the ranks did not finish within {timeout_s:.0f} s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]


def tiny_switch() -> nn.Module:
    """Hugging Face's Switch Transformer (top-1 routing over an nn.ModuleDict of experts in each
    SwitchTransformersSparseMLP), tiny, built from a config: nothing is downloaded."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(
        vocab_size=32,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        num_experts=4,
        expert_capacity=64,  # no token dropped: routing alone decides who is used
        router_jitter_noise=0.0,
        dropout_rate=0.0,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return SwitchTransformersForConditionalGeneration(cfg)


SWITCH = Case("switch", tiny_switch, lambda g, n: {}, lambda out: out.loss)


def switch_batches(steps: int = 2) -> list[list[Batch]]:
    """[rank][step]: one short sequence per rank, so the ranks' tokens pick different experts."""
    out: list[list[Batch]] = [[] for _ in range(RANKS)]
    for step in range(steps):
        for r in range(RANKS):
            g = torch.Generator().manual_seed(10 + r + 2 * step)
            out[r].append(
                {
                    "input_ids": torch.randint(1, 32, (1, 4), generator=g),
                    "labels": torch.randint(1, 32, (1, 3), generator=g),
                }
            )
    return out
