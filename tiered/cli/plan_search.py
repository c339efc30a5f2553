"""`tiered plan`'s search part ([Note: config search]): the pinned knobs and the tokens per step
read from the options, and the chosen config printed as text or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from tiered.errors import ConfigError


def pinned_from_args(args: argparse.Namespace, *, largest_module: int = 0) -> Any:
    """The knobs the flags pin; ``--prefetch-layers L`` as L x `largest_module` elements."""
    from tiered.planning.model_shape import parse_count
    from tiered.planning.search import Pinned

    values: dict[str, Any] = {}
    for name in ("offload_optimizer", "offload_param", "grad_tier", "buffer_count"):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    if args.sub_group_size is not None:
        values["sub_group_size"] = parse_count(args.sub_group_size, what="--sub-group-size")
    if getattr(args, "max_in_cpu", None) is not None:
        values["max_in_cpu"] = (
            0 if args.max_in_cpu in ("0", 0) else parse_count(args.max_in_cpu, what="--max-in-cpu")
        )
    if getattr(args, "persistence_threshold", None) is not None:
        t = args.persistence_threshold
        values["persistence_threshold"] = (
            0 if t in ("0", 0) else parse_count(t, what="--persistence-threshold")
        )
    if getattr(args, "max_live_parameters", None) is not None:
        values["max_live_parameters"] = parse_count(args.max_live_parameters, what="--max-live-parameters")
    if getattr(args, "overlap_step", None) is not None:
        values["overlap_step"] = args.overlap_step == "on"
    if getattr(args, "prefetch_layers", None) is not None:
        values["prefetch_bucket_size"] = args.prefetch_layers * largest_module
    if values.get("buffer_count") is not None and values["buffer_count"] < 1:
        raise ConfigError(f"--buffer-count must be >= 1, got {values['buffer_count']}")
    return Pinned(values)


def tokens_from_args(args: argparse.Namespace) -> int | None:
    """Tokens per optimizer step per rank ([Note: step time model]); None: not given."""
    from tiered.planning.model_shape import parse_count

    if getattr(args, "tokens_per_step", None) is not None:
        n = parse_count(args.tokens_per_step, what="--tokens-per-step")
    elif getattr(args, "seq_len", None) is not None:
        n = args.seq_len * args.micro_batch * args.accumulation
    else:
        return None
    if n < 1:
        raise ConfigError(f"tokens per step must be >= 1, got {n}")
    return int(n)


def _candidate_json(c: Any) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "knobs": c.knobs,
        "config": c.config,
        "peaks_bytes": c.peaks,
        "shortfall_bytes": c.shortfalls,
        "refused": c.refused,
        "seconds_per_step": c.seconds_per_step,
        "bytes_per_step": c.traffic,
        "needs": None if c.prediction is None else c.prediction.needs,
    }


def search_json(result: Any) -> dict[str, Any]:
    placements = []
    for c in result.per_placement():
        row = {k: c.knobs[k] for k in ("offload_optimizer", "offload_param", "grad_tier")}
        placements.append(
            {
                **row,
                "fits": c.fits,
                "peaks_bytes": c.peaks,
                "shortfall_bytes": c.shortfalls,
                "seconds_per_step": c.seconds_per_step,
                "knobs": c.knobs,
            }
        )
    return {
        "best": _candidate_json(result.best),
        "closest": None if result.best is not None else _candidate_json(result.closest),
        "weighed": len(result.weighed),
        "fit": sum(c.fits for c in result.weighed),
        "placements": placements,
    }


_MEMORY_LABEL = {"device": "GPU", "host": "host", "disk": "NVMe"}


def render_placements(result: Any, notes: list[str], out: TextIO) -> None:
    """How many configs were weighed, what was assumed, and per placement (the offloaded rows,
    from the engine's memory model) the fastest config that fits, else the closest."""
    from tiered.units import format_bytes

    w = out.write
    w(
        f"\nconfigs weighed by the engine's own memory model ([Note: one memory model]): {len(result.weighed)}, "
        f"{sum(c.fits for c in result.weighed)} fit\n"
    )
    for n in notes:
        w(f"  assumed: {n}\n")
    rows = result.per_placement()
    if not rows:
        return
    w("per placement, its fastest config that fits, else its closest (peaks per rank, GiB):\n")
    w(f"  {'optimizer':<10}{'params':<8}{'grads':<7}{'GPU':>9}{'host':>9}{'NVMe':>9}{'s/step':>10}  fits\n")
    for c in rows:
        place = f"  {c.knobs['offload_optimizer']:<10}{c.knobs['offload_param']:<8}{c.knobs['grad_tier']:<7}"
        if c.prediction is None:  # refused before any byte was counted: say why, in its first words
            w(f"{place}{'-':>9}{'-':>9}{'-':>9}{'-':>10}  no ({c.refused.split(':')[0].split(';')[0]})\n")
            continue
        gib = {m: c.peaks.get(m, 0) / 2**30 for m in ("device", "host", "disk")}
        short = ", ".join(
            f"{_MEMORY_LABEL[m]} short by {format_bytes(b, binary=True)}" for m, b in c.shortfalls.items()
        )
        w(
            f"{place}{gib['device']:>9.1f}{gib['host']:>9.1f}{gib['disk']:>9.1f}{c.seconds_per_step:>10.3g}  "
            f"{'yes' if c.fits else f'no ({short})'}\n"
        )


def render_search(result: Any, out: TextIO) -> None:
    """The search's answer: the fastest config that fits, or the closest and what it lacks."""
    from tiered.planning.search import shortfall_text
    from tiered.units import format_bytes

    w = out.write
    c = result.best
    if c is None:
        near = result.closest
        if near is None:
            w("nothing fits, and no config could be counted:\n")
            for r in sorted({x.refused for x in result.weighed if x.refused})[:3]:
                w(f"  {r}\n")
            return
        w(f"nothing fits. closest: {_knob_text(near.knobs)}; {shortfall_text(near)}\n")
        w("(add memory on those tiers, use more ranks (--world-size), or a smaller model)\n")
        return
    k = c.knobs
    w(f"\nrecommended: {_knob_text(k)}\n")
    w(
        "  peaks: GPU "
        + format_bytes(c.peaks["device"], binary=True)
        + ", host "
        + format_bytes(c.peaks["host"], binary=True)
        + " (process, transient copies and backend buffers included), NVMe "
        + format_bytes(c.peaks["disk"], binary=True)
        + "\n"
    )
    w(f"  predicted {c.seconds_per_step:.2f} s/step (the slowest of compute, links and CPU Adam)\n")
    w(
        "  bytes per step ([Note: bytes per step]): "
        + ", ".join(f"{link} {format_bytes(b)}" for link, b in c.traffic.items())
        + "\n"
    )
    w('\nrecommended config (DeepSpeed format + "tiered" tier budgets, never above the memory given):\n')
    w(json.dumps(c.config, indent=2) + "\n")


def render_more_memory(lines: list[Any], out: TextIO) -> None:
    """[Note: what more memory buys] as text: per larger memory, the fastest config there."""
    from tiered.units import format_bytes

    if not lines:
        return
    w = out.write
    w("what more memory would buy ([Note: what more memory buys]; the same configs weighed again):\n")
    for m in lines:
        label = {"cpu": "host", "gpu": "GPU"}[m.memory]
        size = format_bytes(m.bytes, binary=True)
        extra = format_bytes(max(0, m.bytes - m.given_bytes), binary=True)
        if m.best is None:
            w(f"  {label} {size} (+{extra}): still nothing fits\n")
            continue
        gain = "" if m.saved_seconds is None else f" ({-m.saved_seconds:+.3g} s)"
        what = (
            "nothing moved on NVMe (the host memory that needs)"
            if m.nothing_on_disk
            else f"optimizer {m.best.knobs['offload_optimizer']}, params {m.best.knobs['offload_param']}"
        )
        w(f"  {label} {size} (+{extra}): {m.best.seconds_per_step:.3g} s/step{gain}, {what}\n")


def more_memory_json(lines: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "memory": m.memory,
            "given_bytes": m.given_bytes,
            "bytes": m.bytes,
            "seconds_per_step": None if m.best is None else m.best.seconds_per_step,
            "saved_seconds_per_step": m.saved_seconds,
            "nothing_on_disk": m.nothing_on_disk,
            "knobs": None if m.best is None else m.best.knobs,
        }
        for m in lines
    ]


def _knob_text(k: dict[str, Any]) -> str:
    return (
        f"optimizer {k['offload_optimizer']}, params {k['offload_param']}, grads {k['grad_tier']}, "
        f"sub_group_size {k['sub_group_size']:,}, buffer_count {k['buffer_count']}, "
        f"persistence threshold {k['persistence_threshold']:,}, max_in_cpu {k['max_in_cpu']:,}"
        + (f", live budget {k['max_live_parameters']:,}" if k.get("max_live_parameters") else "")
        + (
            f", prefetch bucket {k['prefetch_bucket_size']:,}"
            if k.get("prefetch_bucket_size") is not None
            else ""
        )
        + (", step overlapped with backward" if k.get("overlap_step") else "")
    )
