"""`tiered finetune`'s trace and plot: where the engine writes its Perfetto trace (--trace, the
config's tiered.trace_path, or a hidden file for --plot alone), and the per-lane table and the
plot made from it after training."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from tiered.errors import ConfigError


def inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'tiered[plot]' (or pip install matplotlib)"
        ) from None


def with_trace(
    raw: dict[str, Any],
    trace_path: str | Path | None,
    plot_path: str | Path | None,
    rank: int,
    out_dir: Path | None = None,
) -> tuple[dict[str, Any], Path | None, bool]:
    """The config with tiered.trace_path set from --trace, else from the config's own
    trace_path, else (--plot alone) a hidden file next to the plot that the engine writes at
    close and `report_trace` removes (only a name here: a refusal before training leaves
    nothing behind). Returns (config, trace file or None, whether it is temporary). Ranks other
    than 0 record no trace ([Note: ranks in finetune])."""
    import uuid

    raw = copy.deepcopy(raw)
    section = raw.get("tiered")
    if section is not None and not isinstance(section, dict):
        raise ConfigError('the config\'s "tiered" section must be a JSON object')
    own = section.get("trace_path") if isinstance(section, dict) else None
    if rank != 0:
        if isinstance(section, dict):
            section.pop("trace_path", None)
        return raw, None, False
    temp = False
    if trace_path is not None:
        path = Path(str(trace_path))
    elif isinstance(own, str):
        path = Path(own)
    elif plot_path is not None:
        path = Path(str(plot_path)).resolve().parent / f".trace-{uuid.uuid4().hex}.json"
        temp = True
    else:
        return raw, None, False
    # before the model is built ([Note: ranks in finetune]: rank 0 writes it); a folder inside
    # --out is the run's to create ([Note: run directory])
    if not temp and not (out_dir is not None and inside(path, out_dir)):
        from tiered.engine.build import check_trace_path

        check_trace_path(path, "--trace" if trace_path is not None else "tiered.trace_path")
    raw.setdefault("tiered", {})["trace_path"] = str(path)
    return raw, path, temp


def report_trace(w: Any, result: Any, trace_file: Path, temp: bool, plot_path: str | Path | None) -> None:
    """The per-lane table of the last step, the plot, and where the trace is."""
    from tiered.finetune.report import step_table

    try:
        trace = json.loads(trace_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--trace {trace_file}: the engine did not write a readable trace ({exc})"
        ) from None
    try:
        if result.steps_done:
            w("\n" + step_table(trace) + "\n")
        if plot_path is not None and result.steps_done:
            from tiered.finetune.plot import plot_run

            step = plot_run(plot_path, trace, result.losses, result.eval_losses, title="tiered finetune")
            w(f"plot of step {step} and the loss curve written to {plot_path}\n")
    finally:
        if temp:
            trace_file.unlink(missing_ok=True)
    if not temp:
        w(f"trace written to {trace_file} (open it in ui.perfetto.dev)\n")
