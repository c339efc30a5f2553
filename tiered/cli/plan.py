"""`tiered plan`: will it fit? Bytes per rank on GPU / CPU / NVMe for every ZeRO strategy.

The model is in `tiered.planning.accounting` ([Note: plan accounting]); this module parses options
and prints the answer as tables or JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, TextIO

from tiered.cli.plan_compute import compute_rate
from tiered.cli.plan_search import pinned_from_args, render_search, search_json, tokens_from_args
from tiered.errors import ConfigError
from tiered.planning.accounting import TIERS, Memories, PlanOptions, PrecisionBytes, gb
from tiered.planning.verdict import Plan, make_plan
from tiered.units import format_bytes, parse_bytes

DESCRIPTION = """\
Estimate, before launching, the memory each rank needs for plain data parallel, ZeRO-1/2/3 and
ZeRO-3 with the optimizer (and parameters) offloaded to CPU memory or NVMe; whether each fits the
memories you give; the communication per step; and a ready-to-use config (DeepSpeed format plus a
"tiered" section) for the cheapest ZeRO-3 placement that fits.

Bytes per parameter: bf16/fp16 = 2 param + 2 grad + 12 Adam state (fp32 master, m, v); fp32 =
4 + 4 + 8 (m, v; the fp32 parameter is the master). Offloaded: 12 B optimizer state on its tier
and 4 B fp32 gradients in CPU memory per parameter of the rank's shard. All memory figures are
per rank (divide a host's RAM or NVMe by the ranks sharing it). GB = 1e9 bytes.
"""

EPILOG = """\
examples:
  tiered plan --params 40B --gpu-mem 80GB --cpu-mem 512GB --nvme-mem 4TB
  tiered plan --params 7.5e9 --world-size 64 --gpu-mem 32GB
  tiered plan --model ./Llama-2-7b-hf --gpu-mem 24GiB --cpu-mem 64GiB --json
  tiered plan --params 70B --largest-layer 1.05B --activation-mem 6GB --gpu-mem 80GB --cpu-mem 1TB

sizes: 80GB (1e9), 80GiB (2^30), 1e9 or plain bytes.  counts: 40B, 7.5e9, 350M, 1.5T.
exit status: 0 a placement fits (or no memory was given), 1 nothing fits, 2 bad input.
"""


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse names the flag in its error)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def positive_rate(text: str) -> float:
    """An argparse type: a finite rate > 0, e.g. 4e14 (a FLOP/s of 0, nan or inf predicts nothing)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate such as 4e14, got {text!r}") from None
    if not math.isfinite(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite rate > 0, e.g. 4e14, got {text!r}")
    return rate


def _label(tier: str) -> str:
    return {"gpu": "GPU", "cpu": "CPU", "nvme": "NVMe"}.get(tier, tier)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="will it fit? memory per rank for DP and ZeRO-1/2/3 with offload",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", metavar="COUNT", help="number of parameters, e.g. 40B or 7.5e9")
    what.add_argument(
        "--model",
        metavar="PATH",
        help="local Hugging Face model folder or config.json "
        "(counted exactly on the meta device, nothing is allocated)",
    )
    p.add_argument(
        "--largest-layer",
        metavar="COUNT",
        help="parameters of the largest single module (default with --params: 2%% of them)",
    )
    p.add_argument("--gpu-mem", metavar="SIZE", help="GPU memory per rank, e.g. 80GB")
    p.add_argument("--cpu-mem", metavar="SIZE", help="host memory per rank, e.g. 512GB")
    p.add_argument("--nvme-mem", metavar="SIZE", help="NVMe space per rank, e.g. 4TB")
    p.add_argument(
        "--world-size", "-N", type=int, default=1, metavar="N", help="data-parallel ranks (default 1)"
    )
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16", help="default bf16")
    p.add_argument(
        "--prefetch-layers",
        type=int,
        default=1,
        metavar="L",
        help="layers gathered ahead of the one computing (default 1)",
    )
    p.add_argument(
        "--sub-group-size",
        default=None,
        metavar="COUNT",
        help="optimizer pipeline tile in elements (default: searched; the ZeRO table uses 1e8)",
    )
    p.add_argument(
        "--activation-mem",
        default=None,
        metavar="SIZE",
        help="activation memory per rank to add to the GPU working set (default: estimated from "
        "--seq-len/--micro-batch/--checkpointing with the --model's config, else not counted and "
        "the GPU's room left to them: no live budget beyond the default)",
    )
    p.add_argument(
        "--nvme-path", default="./tiered_offload", help="nvme_path written into the recommended config"
    )
    p.add_argument(
        "--accumulation", type=int, default=1, metavar="A", help="gradient_accumulation_steps (default 1)"
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the compute device of the machine that will train: sets the process's own host memory "
        "counted ([Note: one memory model]; default cuda)",
    )
    p.add_argument(
        "--bandwidth",
        metavar="FILE",
        help="link bandwidths from `tiered bench --json FILE` to rank configs by (default: assumed, printed)",
    )
    p.add_argument(
        "--tokens-per-step",
        metavar="COUNT",
        help="tokens per optimizer step per rank: counts the compute in the predicted s/step "
        "([Note: step time model]; default: --seq-len x --micro-batch x --accumulation, or not modelled)",
    )
    p.add_argument("--seq-len", type=positive_int, metavar="T", help="sequence length (with --micro-batch)")
    p.add_argument(
        "--micro-batch",
        type=positive_int,
        default=1,
        metavar="B",
        help="sequences per micro-batch (default 1)",
    )
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing: one more forward counted"
    )
    p.add_argument(
        "--flops",
        type=positive_rate,
        metavar="RATE",
        help="the compute device's FLOP/s for the compute term, e.g. 4e14 (default: with --model and --seq-len, "
        "one layer of the model timed here ([Note: model compute probe]); else a matmul probe here)",
    )
    pin = p.add_argument_group(
        "pinned knobs (the search never varies a knob you give; see [Note: config search])"
    )
    pin.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"))
    pin.add_argument("--offload-param", choices=("none", "cpu", "nvme"))
    pin.add_argument("--grad-tier", choices=("gpu", "cpu", "nvme"), help="tiered.grad_tier")
    pin.add_argument("--buffer-count", type=int, help="offload_optimizer.buffer_count")
    pin.add_argument("--max-in-cpu", metavar="COUNT", help="offload_param.max_in_cpu")
    pin.add_argument("--persistence-threshold", metavar="COUNT", help="stage3_param_persistence_threshold")
    pin.add_argument("--max-live-parameters", metavar="COUNT", help="stage3_max_live_parameters")
    pin.add_argument(
        "--overlap-step",
        choices=("on", "off"),
        help="tiered.overlap_step_with_backward (default: on where it applies)",
    )
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON instead of tables")
    add_lora_argument(p)
    return p


def add_lora_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora",
        metavar="SPEC",
        help="plan a LoRA fine-tune (needs --model): R or r=R,targets=q_proj,v_proj (as tiered finetune "
        "--lora); frozen parameters count p bytes only (2 in bf16), the adapters the full state",
    )


def lora_shape(shape: Any, model_path: str, spec_text: str) -> Any:
    """`shape` with the adapters of `spec_text` added and only they trainable ([Note: LoRA through tiered])."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from tiered.finetune.lora import adapter_params, parse_lora_spec
    from tiered.finetune.model import load_hf_config, resolve_model

    spec = parse_lora_spec(spec_text)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(resolve_model(model_path, weights=False)))
    adapters = adapter_params(model, spec)
    return replace(
        shape,
        total_params=shape.total_params + adapters,
        trainable_params=adapters,
        assumptions=(
            *shape.assumptions,
            f"LoRA {spec.describe()}: {adapters:,} adapter parameters trainable, the rest frozen",
        ),
    )


def _size(value: str | None, option: str) -> int | None:
    return None if value is None else parse_bytes(value, what=option)


def plan_from_args(args: argparse.Namespace) -> Plan:
    from tiered.planning.model_shape import parse_count, shape_from_model, shape_from_params

    opts = PlanOptions(
        world_size=args.world_size,
        precision=args.precision,
        prefetch_layers=args.prefetch_layers,
        sub_group_size=parse_count(args.sub_group_size or "1e8", what="--sub-group-size"),
        activation_bytes=parse_bytes(args.activation_mem or "0", what="--activation-mem"),
        nvme_path=args.nvme_path,
    )
    memories = Memories(
        gpu_bytes=_size(args.gpu_mem, "--gpu-mem"),
        cpu_bytes=_size(args.cpu_mem, "--cpu-mem"),
        nvme_bytes=_size(args.nvme_mem, "--nvme-mem"),
    )
    if args.model is not None:
        shape = shape_from_model(args.model, persistence_threshold=opts.persistence_threshold)
        if args.largest_layer is not None:
            from dataclasses import replace

            big = parse_count(args.largest_layer, what="--largest-layer")
            if big > shape.total_params:
                raise ConfigError(
                    f"--largest-layer ({big:,}) cannot exceed the parameters of --model {args.model} "
                    f"({shape.total_params:,}); give the largest module's count, or leave it out (counted)"
                )
            shape = replace(shape, largest_layer_params=big)
    else:
        shape = shape_from_params(args.params, largest_layer=args.largest_layer)
    if getattr(args, "lora", None) is not None:
        if args.model is None:
            raise ConfigError("--lora needs --model: the adapters' size depends on the model's layer shapes")
        shape = lora_shape(shape, args.model, args.lora)
    return make_plan(shape, memories, opts)


def _fmt(n: int | None) -> str:
    return "-" if n is None else f"{gb(n):.1f}"


def _fits(s: Any) -> str:
    if s.shortfall_bytes:
        return "no (" + ", ".join(f"{_label(t)} +{gb(b):.1f}" for t, b in s.shortfall_bytes.items()) + ")"
    return "yes" if all(v is True for v in s.fits.values()) else "yes?"


def meta_model_from_args(args: argparse.Namespace) -> tuple[Any, tuple[str, ...]]:
    """The module tree the search plans: the real one on the meta device, or the documented
    stand-in for --params ([Note: shape model for --params])."""
    from tiered.planning.model_shape import parse_count
    from tiered.planning.model_sizes import MAX_PARAMS

    if args.model is not None:
        from tiered.planning.hf_config import build_meta_model, resolve_model

        model = build_meta_model(resolve_model(args.model, weights=False))
        said: tuple[str, ...] = ()
    else:
        from tiered.planning.shape_model import shape_model

        big = None if args.largest_layer is None else parse_count(args.largest_layer, what="--largest-layer")
        model, said = shape_model(parse_count(args.params, what="--params", maximum=MAX_PARAMS), big)
    if getattr(args, "lora", None) is not None:
        from tiered.finetune.lora import apply_lora, parse_lora_spec

        model = apply_lora(model, parse_lora_spec(args.lora))
    return model, said


def search_from_args(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """Fit, then fastest ([Note: config search]): the search result and what it assumed."""

    from tiered.planning.needs import host_baseline_bytes
    from tiered.planning.search import Memories, search
    from tiered.planning.timing import DEFAULT_BANDWIDTH, read_bandwidth

    model, said = meta_model_from_args(args)
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if (
        args.model is not None
        and isinstance(max_pos, int)
        and (getattr(args, "seq_len", None) or 0) > max_pos
    ):
        raise ConfigError(  # as tiered finetune refuses it: the model cannot run such sequences
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {max_pos} ({args.model})"
        )
    notes = list(said)
    if args.bandwidth is not None:
        bw, taken = read_bandwidth(args.bandwidth)
        notes += taken
    else:
        bw = dict(DEFAULT_BANDWIDTH)
        notes.append(
            "bandwidths assumed (pass --bandwidth FILE from tiered bench --json): disk "
            f"{bw['disk_read'] / 1e9:.1f} / {bw['disk_write'] / 1e9:.1f} GB/s read / write, host<->device "
            f"{bw['h2d'] / 1e9:.0f} GB/s, CPU Adam {bw['cpu_adam'] / 1e9:.1f}e9 elements/s"
        )
    if args.accumulation < 1:
        raise ConfigError(f"--accumulation must be >= 1, got {args.accumulation}")
    kind = getattr(args, "device", "cuda")
    tokens = compute_rate(args, model, tokens_from_args(args), bw, notes, kind)
    notes.append(
        f"process baseline: {format_bytes(host_baseline_bytes(kind), binary=True)} of host memory for a "
        f"{kind} process, measured ([Note: one memory model]; --device cuda|cpu)"
    )
    activations = _activations(args, model, notes)
    mem = Memories(
        gpu=_size(args.gpu_mem, "--gpu-mem"),
        cpu=_size(args.cpu_mem, "--cpu-mem"),
        nvme=_size(args.nvme_mem, "--nvme-mem"),
        activations=activations,
    )
    result = search(
        model,
        mem,
        pinned_from_args(args),
        precision=args.precision,
        accumulation=args.accumulation,
        world_size=args.world_size,
        nvme_path=args.nvme_path,
        bandwidth=bw,
        device_kind=kind,
        tokens_per_step=tokens,
        checkpointing=bool(getattr(args, "checkpointing", False)),
    )
    return result, notes


def _estimates_activations(args: argparse.Namespace) -> bool:
    """Whether the search counts [Note: activation estimate]: --seq-len with --model, no --activation-mem."""
    return (
        args.activation_mem is None and getattr(args, "seq_len", None) is not None and args.model is not None
    )


def _activations(args: argparse.Namespace, model: Any, notes: list[str]) -> int | None:
    """--activation-mem; else [Note: activation estimate] for --seq-len x --micro-batch with the
    model's config (what `tiered finetune` checks before training); else None (not known)."""
    if args.activation_mem is not None:
        return parse_bytes(args.activation_mem, what="--activation-mem")
    hf_config = getattr(model, "config", None)
    if not _estimates_activations(args) or hf_config is None:
        notes.append(
            "activations: not known (--activation-mem, or --seq-len with --model): the GPU's room "
            "beyond ZeRO-3's working set is left to them"
        )
        return None
    import torch

    from tiered.finetune.activations import estimate_activations

    dtype = {"fp32": torch.float32}.get(args.precision, torch.bfloat16)
    est = estimate_activations(
        hf_config,
        batch=int(args.micro_batch),
        seq_len=int(args.seq_len),
        dtype=dtype,
        checkpointing=bool(getattr(args, "checkpointing", False)),
        compute_on_cpu=getattr(args, "device", "cuda") == "cpu",
    )
    notes.append(f"activations: {est.describe()} ([Note: activation estimate]; --activation-mem to give it)")
    return est.total_bytes


def render(plan: Plan, out: TextIO, *, activations_estimated: bool = False) -> None:
    """The human form: header, strategy table, working set, recommendation and config.
    `activations_estimated`: the search below counts [Note: activation estimate] (--seq-len)."""
    sh, o, m = plan.shape, plan.options, plan.memories
    b = PrecisionBytes.of(o.precision)
    w = out.write
    w(
        f"model: {sh.total_params:,} parameters from {sh.source}; largest layer {sh.largest_layer_params:,}; "
        f"persistent {sh.persistent_params:,}\n"
    )
    for a in sh.assumptions:
        w(f"  assumed: {a}\n")
    w(
        f"precision {o.precision}: {b.param} B param + {b.grad} B grad + K={b.optimizer} B optimizer per parameter; "
        f"world size N={o.world_size}\n"
    )
    w(
        "memory per rank: "
        + ", ".join(
            f"{_label(t)} {_fmt(m.of(t))} GB" if m.of(t) is not None else f"{_label(t)} not given"
            for t in TIERS
        )
        + "\n\n"
    )
    head = (
        f"{'strategy (GB per rank, GB = 1e9 B)':<38} {'GPU state':>9} {'GPU work':>8} {'GPU':>8} "
        f"{'CPU':>8} {'NVMe':>8} {'comm/step':>9}  fits"
    )
    w(head + "\n" + "-" * len(head) + "\n")
    for s in plan.strategies[:4]:
        w(
            f"{s.name:<38} {_fmt(s.bytes_on('gpu', working=False)):>9} {_fmt(s.bytes_on('gpu', working=True)):>8} "
            f"{_fmt(s.bytes_on('gpu')):>8} {_fmt(s.bytes_on('cpu')):>8} {_fmt(s.bytes_on('nvme')):>8} "
            f"{_fmt(s.comm_bytes_per_step):>9}  {_fits(s)}\n"
        )
    w(
        "\ncomm/step: DP/ZeRO-1/2 all-reduce 2*Psi elements, ZeRO-3 3*Psi (1.5x DP), 0 when N=1. "
        "'yes?' = fits the tiers you gave, others not checked.\n"
    )
    w("GPU working set of ZeRO-3 (counted above under 'GPU work'):\n")
    z3 = plan.strategy("zero3")
    for t in z3.terms:
        if t.what.startswith("working:"):
            w(f"  {gb(t.bytes):>8.1f} GB  {t.what.removeprefix('working: ')}\n")
    if activations_estimated:
        w(
            "  activations: not in this table; the configs weighed below count their estimate (see 'assumed')\n"
        )
    elif not o.activation_bytes:
        w(
            "  activations: NOT counted (depend on batch, sequence length, checkpointing); add --activation-mem\n"
        )
    w(
        "(the ZeRO paper's formulas without offload; offloaded placements are weighed below by the "
        "engine's own group planner and capacity check)\n"
    )


def check_all_memory(plan: Plan) -> None:
    """With every tier's memory given, the model's weights alone must fit their sum (per rank:
    ZeRO-3 shards them over the ranks): else nothing can, and the search is not run
    ([Note: plausible model sizes])."""
    from tiered.planning.model_sizes import check_weights_fit

    m, o = plan.memories, plan.options
    given = (m.gpu_bytes, m.cpu_bytes, m.nvme_bytes)
    if any(b is None for b in given):
        return  # a tier not given is not checked: it may hold anything
    check_weights_fit(
        -(-plan.shape.total_params // o.world_size),
        PrecisionBytes.of(o.precision).param,
        sum(b for b in given if b is not None),
        "--gpu-mem + --cpu-mem + --nvme-mem per rank",
        plan.shape.source,
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    plan = plan_from_args(args)
    check_all_memory(plan)
    result, notes = search_from_args(args)
    if args.json:
        doc = plan.to_json()
        doc["strategies"] = doc["strategies"][:4]  # the formulas; offload is the search's
        doc.update(
            search=search_json(result),
            assumed=notes,
            recommended=None if result.best is None else result.best.knobs,
            config=None if result.best is None else result.best.config,
        )
        doc["message"] = "fits" if result.best is not None else "nothing fits"
        out.write(json.dumps(doc, indent=2, default=str) + "\n")
    else:
        render(plan, out, activations_estimated=_estimates_activations(args))
        render_search(result, notes, out)
    return 0 if result.best is not None else 1
