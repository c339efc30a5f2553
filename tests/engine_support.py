"""Shared helpers for the engine / equivalence tests: small models, configs, and the ground truth
(plain PyTorch training with torch.optim.AdamW / Adam) that tiered must reproduce."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = dict[str, torch.Tensor]


# ---- models --------------------------------------------------------------------------------
class MLP(nn.Module):
    """A plain MLP whose forward returns the loss."""

    def __init__(self, d_in: int = 16, hidden: int = 48, d_out: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = F.gelu(self.mid(h))
        return F.mse_loss(self.out(h), y)


class BranchNet(nn.Module):
    """Takes a different layer depending on the data: the trace diverges between steps."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.left = nn.Linear(d, d)
        self.right = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.left(h) if bool(x[0, 0] > 0) else self.right(h)
        return F.mse_loss(self.head(h), y)


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def small_llama_config(**overrides: Any) -> Any:
    """The planner tests' Llama (hidden 64, 2 layers, vocab 512, untied: 0.2M parameters), as a
    transformers LlamaConfig with `overrides` applied."""
    from transformers import LlamaConfig

    base: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**base, **overrides})


def tiny_llama_partly_frozen() -> nn.Module:
    """Frozen embeddings, and a frozen MLP inside the first decoder layer: that block's group is
    split into a trainable and a frozen part."""
    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    return model


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], Batch]
    loss: Callable[[Any], torch.Tensor]


def _mlp_batch(g: torch.Generator, n: int) -> Batch:
    return {"x": torch.randn(n, 16, generator=g), "y": torch.randn(n, 8, generator=g)}


def _branch_batch(g: torch.Generator, n: int) -> Batch:
    x = torch.randn(n, 16, generator=g)
    return {"x": x, "y": torch.randn(n, 4, generator=g)}


def _lm_batch(g: torch.Generator, n: int) -> Batch:
    ids = torch.randint(0, 64, (n, 12), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


CASES = {
    "mlp": Case("mlp", MLP, _mlp_batch, lambda out: out),
    "branch": Case("branch", BranchNet, _branch_batch, lambda out: out),
    "llama": Case("llama", tiny_llama, _lm_batch, lambda out: out.loss),
    "gpt2": Case("gpt2", tiny_gpt2, _lm_batch, lambda out: out.loss),
    "llama_frozen": Case("llama_frozen", tiny_llama_partly_frozen, _lm_batch, lambda out: out.loss),
}


def build(case: Case, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return case.build()


def make_batches(case: Case, steps: int, micro: int, gas: int = 1, seed: int = 1) -> list[Batch]:
    """steps * gas micro-batches of `micro` samples each."""
    g = torch.Generator().manual_seed(seed)
    if case.name == "branch":
        out = []
        for i in range(steps * gas):
            b = case.batch(g, micro)
            b["x"][0, 0] = 1.0 if (i // gas) % 2 == 0 else -1.0  # alternate the branch per step
            out.append(b)
        return out
    return [case.batch(g, micro) for _ in range(steps * gas)]


# ---- configs -------------------------------------------------------------------------------
def ds_config(
    *,
    param: str = "none",
    opt: str = "none",
    nvme_path: str | None = None,
    gas: int = 1,
    clip: float = 0.0,
    dtype: str = "fp32",
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    eps: float = 1e-8,
    optimizer: str = "AdamW",
    adam_w_mode: bool | None = None,
    sub_group_size: int = 2000,
    gpu_budget: int | str | None = None,
    cpu_budget: int | str | None = None,
    buffer_count: int | None = None,
    ratio: float | None = None,
    scheduler: dict[str, Any] | None = None,
    persistence: int = 0,
    extra_zero: dict[str, Any] | None = None,
    fp16: dict[str, Any] | None = None,
    mkdir: bool = True,
) -> dict[str, Any]:
    """A DeepSpeed JSON (stage 3) with a `tiered` section for budgets. DeepSpeed wants nvme_path to
    exist: it is created here unless mkdir=False."""
    if nvme_path is not None and mkdir and "nvme" in (param, opt):
        os.makedirs(nvme_path, exist_ok=True)
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": sub_group_size,
        "stage3_param_persistence_threshold": persistence,
        "stage3_prefetch_bucket_size": 4096,
    }
    if param != "none":
        zero["offload_param"] = {"device": param, **({"nvme_path": nvme_path} if param == "nvme" else {})}
    if opt != "none":
        zero["offload_optimizer"] = {"device": opt, **({"nvme_path": nvme_path} if opt == "nvme" else {})}
        if buffer_count is not None:
            zero["offload_optimizer"]["buffer_count"] = buffer_count
        if ratio is not None:
            zero["offload_optimizer"]["ratio"] = ratio
    zero.update(extra_zero or {})
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": optimizer,
            "params": {
                "lr": lr,
                "betas": [0.9, 0.999],
                "eps": eps,
                "weight_decay": weight_decay,
                **({} if adam_w_mode is None else {"adam_w_mode": adam_w_mode}),
            },
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, **(fp16 or {})}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    tiers: dict[str, Any] = {}
    if gpu_budget is not None:
        tiers["gpu"] = {"backend": {"type": "gpu"}, "budget": gpu_budget}
    if cpu_budget is not None:
        tiers["cpu"] = {"backend": {"type": "cpu"}, "budget": cpu_budget}
    if tiers:
        cfg["tiered"] = {"tiers": tiers}
    return cfg


# ---- ground truth and the run under test ---------------------------------------------------
def faults_tier_config(folder: Path, fault: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
    """ds_config with parameters and optimizer state on a tier "flaky": the faults backend over an
    nvme folder (created in `folder`) injecting `fault`; `timeout_s` sets tiered.timeout_s."""
    (folder / "flaky").mkdir()
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(folder / "nvme"))
    backend = {"type": "faults", "inner": {"type": "nvme", "path": str(folder / "flaky")}, "faults": [fault]}
    cfg["tiered"] = {
        "tiers": {"flaky": {"backend": backend}},
        "param_tier": "flaky",
        "optimizer_tier": "flaky",
        # every step's bytes through the faulty tier: none kept in memory ([Note: residency])
        "residency": "off",
    }
    if timeout_s is not None:
        cfg["tiered"]["timeout_s"] = timeout_s
    return cfg


def reference_train(
    model: nn.Module,
    case: Case,
    batches: Sequence[Batch],
    *,
    gas: int = 1,
    lr: float | Sequence[float] = 1e-3,
    weight_decay: float = 0.01,
    clip: float = 0.0,
    adamw: bool = True,
    dtype: torch.dtype = torch.float32,
    eps: float = 1e-8,
    no_decay: Callable[[str], bool] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: torch.optim.AdamW (or Adam, L2) with the same hyperparameters.

    `lr` may be a per-step list (a scheduler's values). With dtype bf16 the model computes in
    bf16 while the optimizer keeps fp32 masters (the classic mixed-precision reference).
    A parameter that got no gradient in a step (an untaken branch, an idle expert) is not
    stepped, as torch does with zero_grad(set_to_none=True) (and tiered: [Note: parameters
    without a gradient are not stepped]). A frozen parameter (requires_grad=False) is never
    stepped either. `no_decay(name)` selects parameters put in a second param group with weight
    decay 0 (the usual biases-and-norms group)."""
    model = model.train()
    lrs = [lr] * (len(batches) // gas) if isinstance(lr, float) else list(lr)
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    if dtype == torch.float32:
        masters = list(model.parameters())  # frozen ones never get a grad: AdamW skips them
    else:
        params = list(model.parameters())
        masters = [p.detach().clone().float().requires_grad_(p.requires_grad) for p in params]
        model.to(dtype)
    names = [n for n, _ in model.named_parameters()]
    skip = no_decay or (lambda _n: False)
    groups = [
        {"params": [m for n, m in zip(names, masters, strict=True) if not skip(n)]},
        {"params": [m for n, m in zip(names, masters, strict=True) if skip(n)], "weight_decay": 0.0},
    ]
    opt = opt_cls(
        [gr for gr in groups if gr["params"]],
        lr=lrs[0],
        betas=(0.9, 0.999),
        eps=eps,
        weight_decay=weight_decay,
    )
    losses = []
    for i, b in enumerate(batches):
        loss = case.loss(model(**b))
        losses.append(float(loss.detach().float()))
        (loss.float() / gas).backward()
        if (i + 1) % gas:
            continue
        if dtype != torch.float32:
            for p, m in zip(model.parameters(), masters, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        for grp in opt.param_groups:
            grp["lr"] = lrs[i // gas]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dtype != torch.float32:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m.to(dtype))
    named = dict(model.named_parameters())
    if dtype != torch.float32:
        return losses, {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}
    return losses, {n: p.detach().clone() for n, p in named.items()}


def tiered_train(
    model: nn.Module, case: Case, batches: Sequence[Batch], config: dict[str, Any]
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    """The same loop through tiered: engine(**batch), engine.backward, engine.step per micro-batch."""
    import tiered

    losses = []
    with tiered.initialize(model, config) as engine:
        for b in batches:
            loss = case.loss(engine(**b))
            losses.append(float(loss.detach().float()))
            engine.backward(loss)
            engine.step()
        state = {k: v.detach().float().clone() for k, v in engine.zero.gather_full_state_dict().items()}
        stats = engine.stats()
        stats["_engine"] = {"loss_scale": engine.loss_scale, "skipped": engine.skipped_steps}
    return losses, state, stats


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_2 / ||b||_2 over one parameter.

    [Note: equivalence metric] The norm-relative error, not an elementwise one: the ZeRO-3
    layout (parameters as views into 256-byte-aligned flat buffers) lets BLAS pick other
    kernels, so gradients can differ from plain PyTorch's in the last ulp (~1e-7 relative), and
    Adam divides by sqrt(v) + eps: on an element whose gradient is ~1e-9 such an ulp moves the
    update by up to lr * 1e-2. A handful of such elements per tensor are real but meaningless;
    the norm-relative error stays ~1e-7 while a wrong step (missed clip, wrong lr or scale, a
    stale group) moves it by >= 1e-3."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    denom = float(b.norm()) or 1.0
    return float((a - b).norm()) / denom


# fp32 training through tiered vs plain PyTorch: the bound on every parameter (relative).
REL = 1e-5


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float) -> None:
    missing = [n for n in want if n not in got]
    assert not missing, f"tiered's consolidated state lacks {missing} (has {sorted(got)[:8]}...)"
    worst = max(((max_rel_diff(got[n], want[n]), n) for n in want), default=(0.0, ""))
    assert worst[0] <= rel, f"parameter {worst[1]} differs: max rel {worst[0]:.3g} > {rel:g}"


def assert_losses_close(got: Sequence[float], want: Sequence[float], rel: float = REL) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-7), f"loss {i}: tiered {a!r} vs torch {b!r}"


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


@pytest.fixture(autouse=False)
def no_leftover_process_group() -> Iterator[None]:
    """tiered.deepspeed.initialize leaves a one-process group behind, as DeepSpeed does ([Note: one
    process without a launcher]); a test that made one destroys it, so the next starts without."""
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    yield
    if not had and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def load_benchmark(filename: str, module_name: str) -> Any:
    """A script of benchmarks/ imported as module `module_name` (registered in sys.modules, so
    its dataclasses resolve), without putting benchmarks/ on the path."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / filename
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
