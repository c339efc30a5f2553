"""`tiered plan`: will it fit, and how fast? The fastest config that fits the memories given,
weighed by the engine's own memory model ([Note: config search]), beside the ZeRO paper's table
of model-state bytes ([Note: the ZeRO paper's table]).

This module parses the options and prints the answer as text or JSON; `answer` is the one code
path, which `tiered demo` prints too.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from tiered.cli.plan_compute import compute_rate
from tiered.cli.plan_inputs import check_all_memory, positive_int, positive_rate
from tiered.cli.plan_search import (
    more_memory_json,
    pinned_from_args,
    render_more_memory,
    render_placements,
    render_search,
    search_json,
    tokens_from_args,
)

__all__ = [
    "PlanAnswer",
    "add_parser",
    "answer",
    "render",
    "render_placements",
    "render_search",
    "run",
    "to_json",
]
from tiered.errors import ConfigError
from tiered.units import format_bytes, parse_bytes

DESCRIPTION = """\
Weigh, before launching, the configs of ZeRO-3 with the optimizer state, the parameters and the
gradients on the GPU, in CPU memory or on NVMe (and sub_group_size, buffer_count, the persistence
threshold, the live budget, max_in_cpu, the step overlapped with backward) with the engine's own
group planner and pre-flight arithmetic over the real module tree on the meta device; keep those
that fit the memories you give (the process's own host memory and the backends' buffers
included) and print the fastest by predicted s/step, its GPU / host / NVMe peaks, its bytes per
step per link and its config (DeepSpeed format plus a "tiered" section). Every knob you pass is
kept. Before it, the ZeRO paper's model-state bytes of DP and ZeRO-1/2/3 (bf16/fp16: 2 B param +
2 B grad + 12 B Adam state per parameter; fp32: 4 + 4 + 8), which explain why offload is needed.

All memory figures are per rank (divide a host's RAM or NVMe by the ranks sharing it).
"""

EPILOG = """\
examples:
  tiered plan --params 40B --gpu-mem 80GB --cpu-mem 512GB --nvme-mem 4TB
  tiered plan --params 7.5e9 --world-size 64 --gpu-mem 32GB
  tiered plan --model ./Llama-2-7b-hf --gpu-mem 24GiB --cpu-mem 64GiB --json
  tiered plan --model ./my-llama --gpu-mem 80GB --cpu-mem 1TB --seq-len 4096 --checkpointing

sizes: 80GB (1e9), 80GiB (2^30), 1e9 or plain bytes.  counts: 40B, 7.5e9, 350M, 1.5T.
exit status: 0 a config fits (or no memory was given), 1 nothing fits, 2 bad input.
"""


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
        help="with --params: parameters of the largest single module, the stand-in's embedding "
        "([Note: shape model for --params]; default: a 32,000-token vocabulary)",
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
        default=None,
        metavar="L",
        help="layers gathered ahead of the one computing: stage3_prefetch_bucket_size = L x the largest "
        "module's parameters in the config (default: the config's own; the gathered bytes are bounded by "
        "the live budget, which the memory model counts)",
    )
    p.add_argument(
        "--sub-group-size",
        default=None,
        metavar="COUNT",
        help="zero_optimization.sub_group_size: optimizer pipeline tile and group size in elements "
        "(default: searched)",
    )
    p.add_argument(
        "--activation-mem",
        default=None,
        metavar="SIZE",
        help="activation memory per rank, left to them on the GPU (default: estimated from "
        "--seq-len/--micro-batch/--checkpointing with the --model's config, else not counted and "
        "the GPU's room left to them: no live budget beyond the default)",
    )
    p.add_argument(
        "--nvme-path",
        default="./tiered_offload",
        help="the folder on an NVMe drive that NVMe placements write to: the nvme_path of the config "
        "printed (default ./tiered_offload)",
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


def _size(value: str | None, option: str) -> int | None:
    return None if value is None else parse_bytes(value, what=option)


def meta_model_from_args(args: argparse.Namespace) -> tuple[Any, tuple[str, ...]]:
    """The module tree the search plans: the real one on the meta device, or the documented
    stand-in for --params ([Note: shape model for --params])."""
    from tiered.planning.model_shape import parse_count
    from tiered.planning.model_sizes import MAX_PARAMS

    if getattr(args, "lora", None) is not None and args.model is None:
        raise ConfigError("--lora needs --model: the adapters' size depends on the model's layer shapes")
    if args.model is not None:
        if args.largest_layer is not None:
            raise ConfigError(
                "--largest-layer sizes the --params stand-in's largest module; --model counts its own: drop "
                "--largest-layer"
            )
        from tiered.planning.hf_config import build_meta_model, resolve_model

        model = build_meta_model(resolve_model(args.model, weights=False))
        said: tuple[str, ...] = ()
    else:
        from tiered.planning.shape_model import shape_model

        total = parse_count(args.params, what="--params", maximum=MAX_PARAMS)
        big = None if args.largest_layer is None else parse_count(args.largest_layer, what="--largest-layer")
        if big is not None and big > total:
            raise ConfigError(f"--largest-layer ({big:,}) cannot exceed --params ({total:,})")
        model, said = shape_model(total, big)
    if getattr(args, "lora", None) is not None:
        from tiered.finetune.lora import apply_lora, parse_lora_spec

        model = apply_lora(model, parse_lora_spec(args.lora))
    return model, said


@dataclass(frozen=True)
class PlanAnswer:
    """What `tiered plan` answers: the model planned, the memories given, the ZeRO paper's table
    and the search's result, with every assumption in words."""

    shape: Any
    """`ModelShape` of the module tree planned."""
    psi: int
    """Ψ of the ZeRO paper's table: --params as given, else the model's count."""
    memories: Any
    """`tiered.planning.search.Memories`."""
    table: tuple[Any, ...]
    """`tiered.planning.zero_table.PaperRow`s."""
    paper_bytes: Any
    result: Any
    """`tiered.planning.search.SearchResult`."""
    notes: list[str]
    options: dict[str, Any]
    more_memory: list[Any]
    """`tiered.planning.more_memory.MoreMemory` lines ([Note: what more memory buys])."""


def answer(args: argparse.Namespace) -> PlanAnswer:
    """The plan ([Note: config search]): the one path of `tiered plan` and `tiered demo`."""
    from tiered.planning.candidate import plan_base
    from tiered.planning.gpu_room import ASSUMED_ACTIVATION_SHARE
    from tiered.planning.model_shape import parse_count, shape_of_module
    from tiered.planning.more_memory import what_more_memory_buys
    from tiered.planning.needs import host_baseline_bytes
    from tiered.planning.search import Memories, search
    from tiered.planning.timing import DEFAULT_BANDWIDTH, read_bandwidth
    from tiered.planning.zero_table import PaperBytes, zero_table

    if args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    if args.accumulation < 1:
        raise ConfigError(f"--accumulation must be >= 1, got {args.accumulation}")
    if args.prefetch_layers is not None and args.prefetch_layers < 0:
        raise ConfigError(f"--prefetch-layers must be >= 0, got {args.prefetch_layers}")
    base = plan_base(args.precision, args.accumulation)
    mem_given = {
        "gpu": _size(args.gpu_mem, "--gpu-mem"),
        "cpu": _size(args.cpu_mem, "--cpu-mem"),
        "nvme": _size(args.nvme_mem, "--nvme-mem"),
    }
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
    source = (
        f"model {args.model} ({type(model).__name__})"
        if args.model is not None
        else f"--params {args.params}"
    )
    shape = shape_of_module(model, source, assumptions=said)
    psi = parse_count(args.params, what="--params") if args.params is not None else shape.total_params
    check_all_memory(shape, mem_given, args.world_size, int(PaperBytes.of(base.cfg).per_param()["param"]))
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
    kind = getattr(args, "device", "cuda")
    tokens = compute_rate(args, model, tokens_from_args(args), bw, notes, kind)
    notes.append(
        f"process baseline: {format_bytes(host_baseline_bytes(kind), binary=True)} of host memory for a "
        f"{kind} process, measured ([Note: one memory model]; --device cuda|cpu)"
    )
    mem = Memories(**mem_given, activations=_activations(args, model, notes))
    if mem.activations is None and mem.gpu is not None and kind != "cpu":
        notes.append(
            f"activations not known: {ASSUMED_ACTIVATION_SHARE:.0%} of the GPU's room beyond the working set "
            "is left to them ([Note: the GPU's room searched]); --activation-mem or --seq-len sizes them"
        )
    result = search(
        model,
        mem,
        pinned_from_args(args, largest_module=shape.largest_layer_params),
        base=base,
        nvme_path=args.nvme_path,
        world_size=args.world_size,
        bandwidth=bw,
        device_kind=kind,
        tokens_per_step=tokens,
        checkpointing=bool(getattr(args, "checkpointing", False)),
    )
    more = what_more_memory_buys(result)  # [Note: what more memory buys]
    paper = PaperBytes.of(base.cfg)
    table = zero_table(psi, args.world_size, paper, trainable=shape.trainable_params)
    options = {
        "world_size": args.world_size,
        "precision": args.precision,
        "accumulation": args.accumulation,
        "device": kind,
        "nvme_path": args.nvme_path,
    }
    return PlanAnswer(shape, psi, mem, table, paper, result, notes, options, more)


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
    from tiered.planning.text_model import text_config_of

    hf_config = getattr(model, "config", None)
    hf_config = None if hf_config is None else text_config_of(hf_config)
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


def _gb(n: int | None) -> str:
    from tiered.planning.zero_table import gb

    return "-" if n is None else f"{gb(n):.1f}"


def render_zero_table(a: PlanAnswer, out: TextIO) -> None:
    """[Note: the ZeRO paper's table] as text: model states per rank, and whether they fit the GPU."""
    b, gpu = a.paper_bytes.per_param(), a.memories.gpu
    w = out.write
    w(
        f"the ZeRO paper's model states per rank ([Note: the ZeRO paper's table]): Psi = {a.psi:,}, "
        f"{b['param']} B param + {b['grad']} B grad + K={b['optimizer']} B optimizer per parameter, "
        f"N={a.options['world_size']}\n"
    )
    head = f"{'strategy (GB per rank, GB = 1e9 B)':<38} {'GPU state':>9} {'comm/step':>9}  fits the GPU"
    w(head + "\n" + "-" * len(head) + "\n")
    for row in a.table:
        short = row.shortfall(gpu)
        fits = "-" if gpu is None else f"no (GPU +{_gb(short)})" if short else "yes"
        w(f"{row.name:<38} {_gb(row.gpu_bytes):>9} {_gb(row.comm_bytes_per_step):>9}  {fits}\n")
    w(
        "(model states only; the working set, the activations, offload and the process itself are "
        "counted per config below)\n"
    )


def render(a: PlanAnswer, out: TextIO, *, activations_estimated: bool = False) -> None:
    """The human form: the model, the ZeRO paper's table, the placements weighed, the
    recommendation and its config. `activations_estimated`: the search counts [Note: activation
    estimate] (--seq-len)."""
    sh, w = a.shape, out.write
    trainable = "" if sh.trainable_params is None else f"; trainable {sh.trainable_params:,}"
    w(
        f"model: {sh.total_params:,} parameters ({sh.source}); largest module {sh.largest_layer_params:,}; "
        f"persistent {sh.persistent_params:,}{trainable}\n"
    )
    given = {"GPU": a.memories.gpu, "CPU": a.memories.cpu, "NVMe": a.memories.nvme}
    w(
        f"precision {a.options['precision']}; memory per rank: "
        + ", ".join(f"{t} {_gb(v)} GB" if v is not None else f"{t} not given" for t, v in given.items())
        + "\n\n"
    )
    render_zero_table(a, out)
    if activations_estimated:
        w("  activations: the configs weighed below count their estimate (see 'assumed')\n")
    elif a.memories.activations is None:
        w(
            "  activations: NOT counted (depend on batch, sequence length, checkpointing); add --activation-mem "
            "or --seq-len\n"
        )
    render_placements(a.result, a.notes, out)
    render_more_memory(a.more_memory, out)
    render_search(a.result, out)


def to_json(a: PlanAnswer) -> dict[str, Any]:
    """The whole answer as JSON."""
    best = a.result.best
    return {
        "model": asdict(a.shape),
        "memories": asdict(a.memories),
        "options": a.options,
        "zero_table_params": a.psi,
        "bytes_per_param": a.paper_bytes.per_param(),
        "strategies": [row.to_json(a.memories.gpu) for row in a.table],
        "search": search_json(a.result),
        "more_memory": more_memory_json(a.more_memory),
        "assumed": a.notes,
        "recommended": None if best is None else best.knobs,
        "config": None if best is None else best.config,
        "message": "fits" if best is not None else "nothing fits",
    }


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    a = answer(args)
    if args.json:
        out.write(json.dumps(to_json(a), indent=2, default=str) + "\n")
    else:
        render(a, out, activations_estimated=_estimates_activations(args))
    return 0 if a.result.best is not None else 1
