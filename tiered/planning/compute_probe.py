"""The compute term of the predicted s/step measured on the model's own work (issue 21).

[Note: model compute probe]
A matmul probe times one large square product; a training step also runs attention, norms,
rotary embeddings, the loss and GEMMs of small shapes, all below that rate (benchmarks/RESULTS.md,
2026-12-04: the compute was under-predicted ~20% on a steady machine). Where the model is known
(``tiered plan --model DIR`` with ``--seq-len``), `probe_model_compute` times the model's own
work instead: the same config cut to one decoder layer (`one_layer_model`: real tensors, random
weights, the compute dtype, on the device the plan is for), forward + loss + backward at the
planned micro-batch x sequence length. Hooks on the decoder layer split each pass into the
layer's forward, the layer's backward and the rest (embedding, final norm, head, loss: what
runs once per micro-batch whatever the depth), so one pass gives both parts and the step is

    micro-batches x (layers x (layer forward + layer backward) + the rest)
    + micro-batches x layers x layer forward            (activation checkpointing's re-forward)

The pass is repeated (after one untimed warm-up) and the medians taken, for about `seconds`
in all: a few seconds on a 2-core CPU at the 2B replica's shapes. On CUDA each hook
synchronises, so the times are the device's. What it does not see: the engine's own work in the
step (gathers, copies between tiers, hooks), which the link terms count on a GPU host and the
one-thread-fewer timing stands in for on a CPU-only one ([Note: compute beside the engine's
threads] in timing.py), and a load that changes
between the probe and the run (a shared machine's: on two oversubscribed cores two torch threads
ran 3-4x slower than one, and the probe, run with the plan's own thread count, cannot know the
run's; benchmarks/RESULTS.md, 2026-12-04). A model whose one
layer would not fit `max_bytes` (the 36B headline's 128k-vocabulary head alone is 8 GB in fp32)
is not built: the caller falls back to the matmul probe and says so.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer")
"""Attribute names under which transformers' causal LMs keep their decoder layers."""


@dataclass(frozen=True)
class ModelCompute:
    """Medians of the timed passes, in seconds per micro-batch, and the shape timed."""

    layer_forward_s: float
    layer_backward_s: float
    rest_s: float
    layers: int
    micro_batch: int
    seq_len: int
    dtype: torch.dtype
    device: str
    passes: int
    threads: int = 0
    """torch's intra-op threads on a CPU (0: a GPU): on cores shared with other processes, two
    threads waiting on each other can run slower than one (benchmarks/RESULTS.md)."""

    def step_seconds(self, micro_batches: int = 1, *, checkpointing: bool = False) -> float:
        """[Note: model compute probe]: the step's compute from the one-layer times."""
        layer = self.layer_forward_s + self.layer_backward_s
        if checkpointing:
            layer += self.layer_forward_s
        return micro_batches * (self.layers * layer + self.rest_s)

    def describe(self) -> str:
        return (
            f"one decoder layer's forward {self.layer_forward_s * 1e3:.1f} ms + backward "
            f"{self.layer_backward_s * 1e3:.1f} ms x {self.layers} layers, embedding/head/loss "
            f"{self.rest_s * 1e3:.1f} ms, at {self.micro_batch} x {self.seq_len} tokens, "
            f"{str(self.dtype).removeprefix('torch.')} on {self.device}"
            + (f", {self.threads} threads" if self.threads else "")
            + f" (median of {self.passes} timed passes)"
        )


def layer_count(hf_config: Any) -> int:
    n = getattr(hf_config, "num_hidden_layers", None) or getattr(hf_config, "n_layer", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"config has no layer count (num_hidden_layers): {type(hf_config).__name__}")
    return n


def one_layer_config(hf_config: Any) -> Any:
    """A copy of `hf_config` with one decoder layer (per-layer lists, e.g. ``layer_types``, cut)."""
    cfg = copy.deepcopy(hf_config)
    n = layer_count(hf_config)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(cfg, name):
            setattr(cfg, name, 1)
    for name in ("layer_types",):
        value = getattr(cfg, name, None)
        if isinstance(value, list) and len(value) == n:
            setattr(cfg, name, value[:1])
    return cfg


def one_layer_bytes(meta_model: nn.Module, hf_config: Any, itemsize: int) -> int:
    """Parameters + gradients of the one-layer model, from the full model's meta shapes: the
    memory `probe_model_compute` would allocate for weights (activations come on top)."""
    layers = decoder_layers(meta_model)
    per_layer = sum(p.numel() for p in layers[0].parameters())
    in_layers = sum(p.numel() for p in layers.parameters())
    rest = sum(p.numel() for p in meta_model.parameters()) - in_layers
    return 2 * itemsize * (per_layer + rest)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers (``model.model.layers`` for Llama-style models)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES and len(module):
            return module
    raise ValueError(f"no decoder layer list ({', '.join(LAYER_LIST_NAMES)}) in {type(model).__name__}")


def one_layer_model(hf_config: Any, dtype: torch.dtype, device: str) -> nn.Module:
    """`hf_config`'s causal LM cut to one decoder layer, with real (random) weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model: nn.Module = AutoModelForCausalLM.from_config(one_layer_config(hf_config))
    return model.to(device=device, dtype=dtype).train()


def probe_model_compute(
    hf_config: Any,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seconds: float = 2.0,
    max_passes: int = 5,
    warmups: int = 1,
    threads: int | None = None,
) -> ModelCompute:
    """Time the one-layer model's forward + loss + backward ([Note: model compute probe]):
    `warmups` untimed passes, then up to `max_passes` timed ones within about `seconds`; on a
    CPU with `threads` intra-op threads (None: torch's; the plan passes
    `compute_threads_beside_engine`, [Note: compute beside the engine's threads])."""
    from tiered.planning.timing import intra_op_threads

    with intra_op_threads(None if device.startswith("cuda") else threads):
        return _probe(hf_config, micro_batch, seq_len, dtype, device, seconds, max_passes, warmups)


def _probe(
    hf_config: Any,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    device: str,
    seconds: float,
    max_passes: int,
    warmups: int,
) -> ModelCompute:
    """`probe_model_compute`'s passes, at torch's thread count in force."""
    model = one_layer_model(hf_config, dtype, device)
    layer = decoder_layers(model)[0]
    vocab = int(hf_config.vocab_size)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    marks: dict[str, float] = {}

    def now() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(key: str) -> Any:
        def hook(*_: Any) -> None:
            marks[key] = now()

        return hook

    handles = [
        layer.register_forward_pre_hook(mark("fwd0")),
        layer.register_forward_hook(mark("fwd1")),
        layer.register_full_backward_pre_hook(mark("bwd0")),
        layer.register_full_backward_hook(mark("bwd1")),
    ]

    def one_pass() -> tuple[float, float, float]:
        marks.clear()
        t0 = now()
        model(input_ids=ids, labels=ids).loss.backward()
        t1 = now()
        model.zero_grad(set_to_none=True)
        fwd = marks["fwd1"] - marks["fwd0"]
        bwd = marks["bwd1"] - marks["bwd0"]
        return fwd, bwd, (t1 - t0) - fwd - bwd

    try:
        for _ in range(warmups):  # allocator, kernels' first-call costs
            one_pass()
        start = time.perf_counter()
        timed = [one_pass()]
        # another pass while it is expected to end within `seconds` of the first timed one
        while len(timed) < max_passes:
            spent = time.perf_counter() - start
            if spent + spent / len(timed) > seconds:
                break
            timed.append(one_pass())
    finally:
        for h in handles:
            h.remove()
    fwd, bwd, rest = (statistics.median(t[i] for t in timed) for i in range(3))
    return ModelCompute(
        layer_forward_s=fwd,
        layer_backward_s=bwd,
        rest_s=max(rest, 0.0),
        layers=layer_count(hf_config),
        micro_batch=micro_batch,
        seq_len=seq_len,
        dtype=dtype,
        device=device,
        passes=len(timed),
        threads=0 if device.startswith("cuda") else torch.get_num_threads(),
    )
