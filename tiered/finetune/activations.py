"""Activation memory before training: the estimate for a batch, the check against the compute
device's free memory, and turning on Hugging Face gradient checkpointing.

[Note: activation estimate]
For a decoder-only transformer with L layers, hidden size h, a attention heads, vocabulary V,
micro-batch b and sequence length s, the activations kept for backward per layer are

    s * b * h * (34 + 5 * a * s / h)   bytes in 16-bit precision

(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
section 4.1, equation 1, without tensor or sequence parallelism); fp32 doubles it. Added: the
logits and their gradient, 2 * b * s * V * 4 bytes (Hugging Face upcasts the logits to fp32 for
the loss). With gradient checkpointing each layer keeps only its input, 2 * s * b * h bytes
(16-bit; fp32 doubles), plus one layer's full activations while it is recomputed. The estimate
is for eager attention (the a * s^2 term); it is compared with the free memory of the compute
device (the GPU; on a machine without one the "gpu" tier is host memory, and MemAvailable is
used) plus nothing else, so it is a lower bound on the need: a batch refused by it can never fit.

[Note: per-shape kernels of a CPU MoE]
Where the compute runs on the CPU in 16-bit precision, torch multiplies through oneDNN, which
builds (JIT-compiles) a kernel for every new matrix shape and keeps it. A dense model has a few
shapes, paid once (in the measured process baseline, [Note: one memory model]). A routed MoE's
experts do not: Hugging Face's expert loop multiplies each expert's tokens as they come, so every
new token count is a new shape, for the expert's two weight shapes forward and backward (six
products). The count of an expert's tokens lies in 1..batch x seq, and a run meets most of those
values (the zoo's MoE, batch 1 x 64 tokens: 40 counts by step 3, all 64 by step 30), so the
estimate counts batch x seq of them. Measured by benchmarks/cpu_shape_kernels.py (torch
2.13.0+cpu, oneDNN 3.12, AVX-512; bf16 expert MLPs forward and backward, one new token count at a
time; 2026-12-06): 3.95-4.07 MiB per count while oneDNN's primitive cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 products, so ~170 counts) holds it, and 1.0-1.6 MiB per
count beyond it (the cache is not all of it: at capacity 0 a count still costs 2.2-2.5 MiB); the
same for matrices of 64x224 and 512x1024, so it does not scale with the model. So
``CPU_EXPERT_COUNT_BYTES`` per count, at most ``CPU_CACHED_COUNTS`` of them, and
``CPU_UNCACHED_COUNT_BYTES`` per count beyond (the upper figure). fp32 builds no such kernels
(0.06-0.11 MiB per count), nor does a GPU's compute (host memory is the point
here: this is what the host of a CPU-only run holds). benchmarks/RESULTS.md has the zoo's MoE
with and without it (issue 21).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from tiered.errors import CapacityError, ConfigError
from tiered.units import format_bytes

log = logging.getLogger(__name__)

CPU_EXPERT_COUNT_BYTES = 4 * 2**20
"""Host memory of one new expert token count on a CPU, measured: [Note: per-shape kernels of a CPU MoE]."""
CPU_CACHED_COUNTS = 1024 // 6
"""Token counts oneDNN's primitive cache holds at its default capacity (six products each)."""
CPU_UNCACHED_COUNT_BYTES = 2 * 2**20
"""A count's cost beyond the cache's capacity (measured 1.0-1.6 MiB; 2.2-2.5 MiB at capacity 0)."""
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Where transformers configs name their routed experts (Mixtral; Qwen-MoE, OLMoE; DeepSeek; others)."""


@dataclass(frozen=True)
class ActivationEstimate:
    """[Note: activation estimate] for one micro-batch, with its inputs for the message."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    batch: int
    seq_len: int
    bytes_per_value: int
    checkpointing: bool
    routed_experts: int = 0
    """Experts tokens are routed to (0: a dense model)."""
    compute_on_cpu: bool = False
    """The compute runs on the CPU (a machine without a GPU): its per-shape kernels are host memory."""

    @property
    def expert_kernels_bytes(self) -> int:
        """[Note: per-shape kernels of a CPU MoE]: 0 unless a 16-bit MoE computes on the CPU."""
        if not (self.compute_on_cpu and self.routed_experts > 1 and self.bytes_per_value == 2):
            return 0
        counts = self.batch * self.seq_len
        cached = min(counts, CPU_CACHED_COUNTS)
        return cached * CPU_EXPERT_COUNT_BYTES + (counts - cached) * CPU_UNCACHED_COUNT_BYTES

    @property
    def per_layer_bytes(self) -> int:
        s, b, h, a = self.seq_len, self.batch, self.hidden, self.heads
        half = s * b * h * (34 + 5 * a * s / h)
        return int(half * self.bytes_per_value / 2)

    @property
    def logits_bytes(self) -> int:
        return 2 * self.batch * self.seq_len * self.vocab * 4

    @property
    def total_bytes(self) -> int:
        if self.checkpointing:
            kept = self.layers * self.seq_len * self.batch * self.hidden * self.bytes_per_value
            return kept + self.per_layer_bytes + self.logits_bytes + self.expert_kernels_bytes
        return self.layers * self.per_layer_bytes + self.logits_bytes + self.expert_kernels_bytes

    def describe(self) -> str:
        how = "checkpointed: layer inputs + one layer" if self.checkpointing else f"{self.layers} layers"
        return (
            f"~{format_bytes(self.total_bytes, binary=True)} of activations for batch {self.batch} x seq "
            f"{self.seq_len} ({how}; {format_bytes(self.per_layer_bytes, binary=True)} per layer, logits "
            f"{format_bytes(self.logits_bytes, binary=True)}"
            + (
                f"; the experts' per-shape CPU kernels {format_bytes(self.expert_kernels_bytes, binary=True)}"
                if self.expert_kernels_bytes
                else ""
            )
            + ")"
        )


def estimate_activations(
    hf_config: Any, *, batch: int, seq_len: int, dtype: torch.dtype, checkpointing: bool, compute_on_cpu: bool
) -> ActivationEstimate:
    """[Note: activation estimate] from a transformers config (Llama-style or GPT-2 names), with
    an MoE's per-shape kernels where `compute_on_cpu` ([Note: per-shape kernels of a CPU MoE])."""

    def get(*names: str) -> int:
        for n in names:
            v = getattr(hf_config, n, None)
            if isinstance(v, int):
                return v
        raise ConfigError(f"--model: config has none of {names}; cannot estimate the activation memory")

    return ActivationEstimate(
        layers=get("num_hidden_layers", "n_layer"),
        hidden=get("hidden_size", "n_embd"),
        heads=get("num_attention_heads", "n_head"),
        vocab=get("vocab_size"),
        batch=batch,
        seq_len=seq_len,
        bytes_per_value=4 if dtype == torch.float32 else 2,
        checkpointing=checkpointing,
        routed_experts=next(
            (v for k in EXPERT_COUNT_KEYS if isinstance(v := getattr(hf_config, k, None), int)), 0
        ),
        compute_on_cpu=compute_on_cpu,
    )


def compute_free_bytes(device: torch.device) -> tuple[int, str]:
    """Free bytes where activations live, and what that memory is, in words."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"GPU {device} free memory"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(
                        line.split()[1]
                    ) * 1024, "host memory available (MemAvailable; the gpu tier is host memory here)"
    except OSError:
        pass
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size), "host physical memory (the gpu tier is host memory here)"


def check_activations(
    est: ActivationEstimate, device: torch.device, free: tuple[int, str] | None = None
) -> None:
    """CapacityError with the numbers when the batch's activations cannot fit, before training."""
    have, what = free if free is not None else compute_free_bytes(device)
    if est.total_bytes > have:
        hint = "" if est.checkpointing else ", or add --gradient-checkpointing"
        raise CapacityError(
            f"--batch-size {est.batch} x --seq-len {est.seq_len}: {est.describe()} exceed the {what}, "
            f"{format_bytes(have, binary=True)}; lower --batch-size or --seq-len{hint}"
        )


def enable_gradient_checkpointing(model: torch.nn.Module, *, reentrant: bool) -> None:
    """Hugging Face gradient checkpointing on `model` (a transformers model, or peft around one).

    [Note: checkpointing and frozen parameters] Both torch modes work with frozen parameters
    (LoRA's base): the non-reentrant recomputation saves a frozen Parameter by reference, which
    tiered/zero hands it as a detached alias instead ([Note: recomputed frozen parameters] in
    tiered/zero/saved.py); the reentrant one needs an input that requires grad (below)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    base: Any = model
    if not hasattr(base, "gradient_checkpointing_enable") and hasattr(base, "get_base_model"):
        base = base.get_base_model()
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"--gradient-checkpointing: {type(base).__name__} does not support gradient checkpointing"
        )
    kwargs = {"use_reentrant": reentrant}
    # transformers >= 5.x names it activation_checkpointing_enable (the old name warns)
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if reentrant and frozen:
        # reentrant checkpointing needs an input that requires grad; with frozen embeddings
        # nothing would, and the adapters inside the checkpointed layers would get no gradient
        base.enable_input_require_grads()
    if hasattr(base, "config"):
        base.config.use_cache = False
