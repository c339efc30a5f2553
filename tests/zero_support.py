"""Shared helpers for the ZeRO-3 tests: tier managers over the real backends, tiny models,
and plain-PyTorch reference gradients."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tiered
from tiered.config.schema import (
    TieredConfig,
    ZeroConfig,
)
from tiered.tiers import Tier, TierManager
from tiered.zero import ZeroParameters


def make_tm(tmp_path: Path, *, gpu_budget: int | None = None, cpu_budget: int | None = None) -> TierManager:
    """gpu (host memory with a budget here), cpu (pinned host) and nvme (files in tmp_path) tiers."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    return TierManager(
        [
            Tier("gpu", tiered.open_backend({"type": "gpu"}), gpu_budget),
            Tier("cpu", tiered.open_backend({"type": "cpu"}), cpu_budget),
            Tier("nvme", tiered.open_backend({"type": "nvme", "path": str(nvme)}), None),
        ],
        timeout_s=60.0,
    )


def zcfg(**zero: Any) -> TieredConfig:
    """A TieredConfig with the given ZeroConfig fields (small defaults good for tiny models)."""
    base = dict(param_persistence_threshold_numel=0, prefetch_bucket_size_numel=10_000)
    base.update(zero)
    return TieredConfig(zero=ZeroConfig(**base))


def build_zp(
    model: nn.Module,
    tm: TierManager,
    cfg: TieredConfig | None = None,
    *,
    param_tier: str = "cpu",
    grad_tier: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **kw: Any,
) -> ZeroParameters:
    return ZeroParameters(
        model, tm, cfg or zcfg(), param_tier=param_tier, grad_tier=grad_tier, compute_dtype=dtype, **kw
    )


class MLP(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def reference_grads(model: nn.Module, loss_fn: Any, batches: list[Any]) -> dict[str, torch.Tensor]:
    """Accumulated .grad of a plain copy of `model` over `batches` (loss_fn(model, batch) -> loss)."""
    ref = copy.deepcopy(model)
    for b in batches:
        loss_fn(ref, b).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def zero_grads_by_name(zp: ZeroParameters) -> dict[str, torch.Tensor]:
    """The accumulated fp32 grads of a world-size-1 ZeroParameters, unflattened by parameter name."""
    out = {}
    for g in zp.groups:
        if not g.trainable:  # frozen: no gradient partition at all
            continue
        shard = zp.read_grad_shard(g)
        for e in g.entries:
            out[e.name] = shard[e.offset : e.offset + e.numel].view(e.shape)
    return out


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_grad_worker(rank: int, world: int, port: int, tmp: str, dtype_name: str) -> None:
    """One gloo rank: its part of a global batch through ZeroParameters, for an MLP (params on
    nvme, tight gpu budget) and a tiny GPT-2 (tied embeddings); results saved to
    tmp/result{rank}.pt (tensors through a queue would outlive the process that shares them)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    out = {}
    try:
        for kind in ("mlp", "gpt2"):
            torch.manual_seed(0)
            if kind == "mlp":
                model = MLP(d=24, depth=3)
                batches = [x.chunk(world)[rank] for x in torch.randn(2, 8, 24)]  # 2 micro-batches of 8

                def loss_of(b: torch.Tensor, model: nn.Module = model) -> torch.Tensor:
                    return model(b).pow(2).mean()
            else:
                model = tiny_gpt2()
                batches = [x.chunk(world)[rank] for x in torch.randint(0, 64, (2, 4, 16))]

                def loss_of(b: torch.Tensor, model: nn.Module = model) -> torch.Tensor:
                    return model(input_ids=b, labels=b).loss

            with make_tm(Path(tmp) / f"{kind}{rank}", gpu_budget=256 * 1024) as tm:
                zp = build_zp(
                    model,
                    tm,
                    zcfg(param_persistence_threshold_numel=40),
                    param_tier="nvme",
                    dtype=getattr(torch, dtype_name),
                )
                for b in batches:
                    loss_of(b).backward()
                    s = zp.finish_backward()
                shards = {g.name: (g.shard_offset, g.shard_numel, zp.read_grad_shard(g)) for g in zp.groups}
                entries = {g.name: g.entries for g in zp.groups}
                sd = zp.gather_full_state_dict()
                out[kind] = (shards, entries, s.sq_norm_local, sd, tm.peak_bytes("gpu"))
        torch.save(out, Path(tmp) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()
