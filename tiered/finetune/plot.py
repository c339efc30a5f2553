"""`tiered finetune --plot FILE.png`: the timeline of one step and the loss curve, with matplotlib.

[Note: step timeline plot]
The picture is drawn from the run's trace (the same events `--trace` writes, [Note: trace
lanes], [Note: compute spans]): the last traced step (steady state: the schedule is recorded and
prefetch runs) is cut out by its "step N" span, and every event that overlaps it is drawn as a
bar on a lane: "compute" (forward and backward per block), one lane per link (source->
destination; the lanes Perfetto needs for overlapping moves are merged back, drawn translucent
so overlap shows as darker), and "adam" (the update of each group). Below it, the train loss per
step and the eval losses. matplotlib is an optional extra (`pip install tiered[plot]`); it is
imported only here, with the Agg canvas, so no display is needed and pyplot's global state is
not touched.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered.errors import ConfigError

_LANE_SUFFIX = re.compile(r" #\d+$")
_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "adam": "#55A868", "link": "#8172B3"}


def step_window(events: Sequence[dict[str, Any]]) -> tuple[int, float, float]:
    """(step, start µs, end µs) of the last "step N" span of a trace's events."""
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
    if not steps:
        raise ValueError("the trace has no step spans; was it recorded by tiered finetune?")
    last = max(steps, key=lambda e: e["ts"])
    return int(str(last["name"]).split()[-1]), float(last["ts"]), float(last["ts"] + last["dur"])


def timeline_lanes(
    events: Sequence[dict[str, Any]], start: float, end: float
) -> dict[str, list[tuple[float, float, str]]]:
    """Per lane (compute, each link, adam), the (start ms, length ms, name) of the events that
    overlap [start, end] µs, times relative to `start`."""
    lanes: dict[str, list[tuple[float, float, str]]] = {"compute": []}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") == "step":
            continue
        t0, dur = float(e["ts"]), float(e["dur"])
        if t0 > end or t0 + dur < start:
            continue
        lane = _LANE_SUFFIX.sub("", str(e["cat"]))
        lanes.setdefault(lane, []).append(((t0 - start) / 1e3, max(dur, 1.0) / 1e3, str(e["name"])))
    links = sorted(k for k in lanes if k not in ("compute", "adam"))
    order = ["compute", *links, *(["adam"] if "adam" in lanes else [])]
    return {k: lanes[k] for k in order}


def _color(lane: str, name: str) -> str:
    if lane == "compute":
        return _COLORS["backward"] if name.startswith("backward") else _COLORS["forward"]
    return _COLORS["adam"] if lane == "adam" else _COLORS["link"]


def plot_run(
    path: str | Path,
    trace: dict[str, Any],
    losses: Sequence[float],
    eval_losses: Sequence[tuple[int, float]] = (),
    *,
    title: str = "",
) -> int:
    """Write the PNG ([Note: step timeline plot]); returns the step drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'tiered[plot]' (or pip install matplotlib)"
        ) from None
    events = trace.get("traceEvents", [])
    step, start, end = step_window(events)
    lanes = timeline_lanes(events, start, end)
    fig = Figure(figsize=(10, 2.2 + 0.45 * len(lanes) + 2.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 1, height_ratios=[0.45 * len(lanes) + 0.8, 2.4])
    ax = fig.add_subplot(grid[0])
    names = list(lanes)
    for row, lane in enumerate(names):
        bars = lanes[lane]
        y = len(names) - 1 - row
        translucent = lane not in ("compute",)
        for t0, dur, name in bars:
            ax.broken_barh(
                [(t0, dur)],
                (y - 0.35, 0.7),
                facecolors=_color(lane, name),
                alpha=0.55 if translucent else 0.95,
                # white edges keep consecutive blocks (layer after layer) apart
                edgecolor="none" if translucent else "white",
                linewidth=0.6,
            )
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlim(0, max((end - start) / 1e3, max((t + d for b in lanes.values() for t, d, _ in b), default=0)))
    ax.set_xlabel("ms since the start of the step")
    ax.set_title(f"{title + ': ' if title else ''}timeline of step {step}", loc="left")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[
            Patch(color=_COLORS["forward"], label="forward"),
            Patch(color=_COLORS["backward"], label="backward"),
            Patch(color=_COLORS["link"], alpha=0.55, label="transfer"),
            Patch(color=_COLORS["adam"], alpha=0.55, label="Adam (per group)"),
        ],
        loc="lower right",  # above the lanes, level with the title: it hides no bar
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
        ncols=4,
        frameon=False,
    )
    lx = fig.add_subplot(grid[1])
    lx.plot(range(1, len(losses) + 1), list(losses), color=_COLORS["forward"], label="train loss")
    if eval_losses:
        lx.plot(
            [s for s, _ in eval_losses],
            [v for _, v in eval_losses],
            "o-",
            color=_COLORS["backward"],
            label="eval loss",
        )
    lx.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    lx.set_xlabel("step")
    lx.set_ylabel("loss")
    lx.grid(alpha=0.3)
    lx.legend(fontsize="small")
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ConfigError(f"--plot {path}: cannot write ({exc.strerror or exc})") from None
    return step
