"""Human-readable tables of an engine's stats (engine.stats()): per tier and per link."""

from __future__ import annotations

from typing import Any

from tiered.units import format_bytes


def _b(n: Any) -> str:
    return "-" if n is None else format_bytes(int(n), binary=True)


def tier_table(stats: dict[str, Any], *, gpu_is_host: bool | None = None) -> str:
    """Peak and current resident bytes, reads, writes and stall seconds per tier; then bytes
    moved, GB/s and operations per link (source->destination); then totals. Without a GPU
    (`gpu_is_host`, default: no CUDA device here) the "gpu" tier is the compute device's memory,
    which is host memory, and the table says so."""
    tiers = stats.get("tiers", {})
    lines = [
        f"{'tier':<16} {'budget':>11} {'peak resident':>14} {'resident':>11} {'reads':>7} "
        f"{'writes':>7} {'stall s':>8}"
    ]
    if gpu_is_host is None:
        import torch

        gpu_is_host = not torch.cuda.is_available()
    host_gpu = gpu_is_host and "gpu" in tiers.get("tiers", {})
    for name, t in tiers.get("tiers", {}).items():
        label = "gpu (host mem)" if host_gpu and name == "gpu" else name
        lines.append(
            f"{label:<16} {_b(t.get('budget_bytes')):>11} {_b(t.get('peak_bytes')):>14} "
            f"{_b(t.get('resident_bytes')):>11} {t.get('reads', 0):>7} {t.get('writes', 0):>7} "
            f"{t.get('stall_s', 0.0):>8.3f}"
        )
    if host_gpu:
        lines.append('(no GPU here: the "gpu" tier is the compute device\'s memory, i.e. host memory)')
    lines.append("")
    lines.append(f"{'link':<16} {'bytes moved':>11} {'GB/s':>8} {'ops':>7} {'busy s':>8}")
    links = tiers.get("links", {})
    for name, lk in links.items():
        lines.append(
            f"{name:<16} {_b(lk.get('bytes')):>11} {lk.get('gbps', 0.0):>8.3f} {lk.get('ops', 0):>7} "
            f"{lk.get('seconds', 0.0):>8.3f}"
        )
    if not links:
        lines.append("(no moves between tiers: everything stayed in its home tier)")
    total = sum(int(lk.get("bytes", 0)) for lk in links.values())
    lines.append(
        f"total moved {_b(total)}; stall {tiers.get('stall_s', 0.0):.3f} s (time the training thread "
        f"waited for data); evictions {tiers.get('evictions', 0)}, write-backs {tiers.get('writebacks', 0)}"
    )
    timing = stats.get("timing", {}).get("total")
    if timing:
        lines.append(
            "engine time: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in timing.items())
        )
    return "\n".join(lines)


def step_table(trace: dict[str, Any]) -> str:
    """Per lane of the last traced step (compute, each link, Adam): events and busy time (the
    union of its events' intervals, so overlapping moves count once), against the step's length."""
    from tiered.finetune.plot import step_window, timeline_lanes

    events = trace.get("traceEvents", [])
    step, start, end = step_window(events)
    length_ms = (end - start) / 1e3
    lines = [f"step {step}: {length_ms:.1f} ms", f"{'lane':<16} {'events':>7} {'busy ms':>9} {'of step':>8}"]
    for lane, bars in timeline_lanes(events, start, end).items():
        busy, reach = 0.0, float("-inf")
        for t0, dur, _ in sorted(bars):
            t1 = min(t0 + dur, length_ms)
            t0 = max(t0, reach, 0.0)
            if t1 > t0:
                busy += t1 - t0
            reach = max(reach, t1)
        share = busy / length_ms if length_ms > 0 else 0.0
        lines.append(f"{lane:<16} {len(bars):>7} {busy:>9.1f} {share:>8.0%}")
    return "\n".join(lines)
