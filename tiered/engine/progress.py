"""`steps_per_print` and `wall_clock_breakdown`: the engine's progress line, as DeepSpeed prints it.

[Note: progress at steps_per_print]
Every `steps_per_print` optimizer steps (counting skipped fp16 steps, as DeepSpeed's
``global_steps`` does) the engine logs one INFO line on the "tiered.engine" logger: the step,
the lr, the loss scale, the global gradient norm and the skipped steps. With
`wall_clock_breakdown` it logs a second line with the forward, backward and step seconds of the
last step (all its micro-batches). Nothing is printed: logging is configured by the application.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("tiered.engine")


def report_step(engine: Any, last_step: dict[str, float]) -> None:
    """Called by Engine.step after each optimizer step (`last_step`: its seconds per phase); logs
    at the configured cadence."""
    cfg = engine.config
    if engine.global_steps % max(1, int(cfg.steps_per_print)) != 0:
        return
    norm = engine.last_grad_norm
    log.info(
        "step %d: lr %.6g, loss scale %g, grad norm %s, skipped steps %d",
        engine.global_steps,
        engine.get_lr()[0],
        engine.loss_scale,
        "n/a" if norm is None or norm != norm else f"{norm:.6g}",
        engine.skipped_steps,
    )
    if cfg.wall_clock_breakdown:
        log.info(
            "step %d time: forward %.4f s, backward %.4f s, step %.4f s",
            engine.global_steps,
            last_step.get("forward_s", 0.0),
            last_step.get("backward_s", 0.0),
            last_step.get("step_s", 0.0),
        )
