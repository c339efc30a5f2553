"""`tiered plan`'s compute rate for the predicted s/step ([Note: step time model]): given
(``--flops``, the bench file's compute entry), measured on the model's own work where the model
and sequence length are known ([Note: model compute probe]), or a matmul probe otherwise."""

from __future__ import annotations

import argparse
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PROBE_MAX_BYTES = 4 << 30
"""The most parameter + gradient bytes the model probe allocates for its one-layer model; above
it (a 128k-vocabulary head of an 8192-wide model is 8 GB in fp32) the matmul probe stands in."""


def compute_rate(
    args: argparse.Namespace,
    model: Any,
    tokens: int | None,
    bw: MutableMapping[str, float],
    notes: list[str],
    kind: str,
) -> int | None:
    """Set ``bw["flops"]`` for the compute term and say where it came from; the tokens per step
    to count the compute for (None: compute not modelled)."""
    if not tokens:
        notes.append("compute: not modelled (give --tokens-per-step or --seq-len to count it)")
        return None
    import torch

    checkpointing = bool(getattr(args, "checkpointing", False))
    if getattr(args, "flops", None) is not None:
        bw["flops"] = float(args.flops)
        notes.append(f"compute {bw['flops'] / 1e12:.3f} TFLOP/s (--flops)")
    elif kind == "cuda" and not torch.cuda.is_available():
        if "flops" not in bw:
            notes.append(
                "compute: not modelled: planning for a GPU on a machine without one (give --flops, or "
                "--bandwidth FILE with a compute entry)"
            )
            return None
    else:
        device = "cuda" if kind == "cuda" else "cpu"
        # the model probe runs in the compute dtype; the matmul probe as before (fp32 on a CPU)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
        if not _model_probe(args, model, tokens, bw, notes, device, dtype, checkpointing):
            _matmul_probe(bw, notes, device, torch.float32 if device == "cpu" else dtype)
    notes.append(f"compute: {tokens:,} tokens per step x {'8' if checkpointing else '6'} FLOPs per parameter")
    return tokens


def _model_probe(
    args: argparse.Namespace,
    model: Any,
    tokens: int,
    bw: MutableMapping[str, float],
    notes: list[str],
    device: str,
    dtype: torch.dtype,
    checkpointing: bool,
) -> bool:
    """[Note: model compute probe] for --model with --seq-len; False (and why, in `notes`) where
    it does not apply, for the matmul probe to stand in."""
    import torch

    from tiered.planning.compute_probe import one_layer_bytes, probe_model_compute
    from tiered.planning.timing import training_flops
    from tiered.units import format_bytes

    hf_config = getattr(model, "config", None)
    if getattr(args, "model", None) is None or hf_config is None or getattr(args, "seq_len", None) is None:
        if getattr(args, "model", None) is not None:
            notes.append("compute: the model's own layer not timed (give --seq-len); a matmul probe instead")
        return False
    itemsize = torch.empty(0, dtype=dtype).element_size()
    try:
        need = one_layer_bytes(model, hf_config, itemsize)
    except ValueError as exc:
        notes.append(f"compute: the model's own layer not timed ({exc}); a matmul probe instead")
        return False
    if need > PROBE_MAX_BYTES:
        notes.append(
            f"compute: the model's own layer not timed (one layer + embedding/head need "
            f"{format_bytes(need, binary=True)} > {format_bytes(PROBE_MAX_BYTES, binary=True)}); a matmul "
            "probe instead (or give --flops)"
        )
        return False
    from tiered.planning.timing import compute_threads_beside_engine

    replaces = " (instead of the bench file's matmul rate)" if "flops" in bw else ""
    try:
        probe = probe_model_compute(
            hf_config,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            dtype=dtype,
            device=device,
            # [Note: compute beside the engine's threads]
            threads=compute_threads_beside_engine() if device == "cpu" else None,
        )
    except Exception as exc:  # noqa: BLE001 - a config the model cannot run with is the user's to fix
        from tiered.errors import ConfigError

        raise ConfigError(
            f"--model {args.model}: one layer of the model, built from its config.json, fails to run "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); training it would fail "
            "the same way: check the sizes in its config.json, or "
            "give --flops to plan without running it"
        ) from None
    micro_batches = tokens / (args.micro_batch * args.seq_len)
    seconds = probe.step_seconds(checkpointing=checkpointing) * micro_batches
    params = sum(p.numel() for p in model.parameters())
    # The search counts compute as FLOPs over a rate: the rate that makes it the measured seconds.
    bw["flops"] = training_flops(params, tokens, checkpointing=checkpointing) / seconds
    notes.append(
        f"compute {seconds:.3f} s/step measured on the model's own work ([Note: model compute probe]): "
        f"{probe.describe()}; {micro_batches:g} micro-batch(es) per step"
        + (", the layers' forward run twice (checkpointing)" if checkpointing else "")
        + f" (= {bw['flops'] / 1e12:.3f} TFLOP/s effective){replaces}"
    )
    return True


def _matmul_probe(bw: MutableMapping[str, float], notes: list[str], device: str, dtype: torch.dtype) -> None:
    """The bench file's compute entry if it had one, else a timed matmul here."""
    if "flops" in bw:
        return
    from tiered.planning.timing import compute_threads_beside_engine, probe_flops

    threads = compute_threads_beside_engine() if device == "cpu" else None
    bw["flops"] = probe_flops(device, dtype, threads=threads)
    notes.append(
        f"compute {bw['flops'] / 1e12:.3f} TFLOP/s: a {dtype} matmul timed on this machine's {device} "
        + (
            f"with {threads} thread(s), one fewer than the run's ([Note: compute beside the engine's threads]) "
            if threads
            else ""
        )
        + "([Note: step time model]; --bandwidth FILE with a compute entry to give it)"
    )
