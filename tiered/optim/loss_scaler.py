"""Loss scaling for fp16 training, with DeepSpeed's semantics.

[Note: loss scaling]
fp16 gradients underflow unless the loss is multiplied by a large scale before backward. The
engine multiplies the loss by `scale`, the gradients it accumulates are therefore scaled, and the
optimizer divides by `scale` on the fly (the kernel's ``grad_scale``). A step whose gradients hold
an inf/nan is skipped and the scale is lowered; after ``window`` clean steps it is raised again.
This mirrors ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` exactly, hysteresis
included: with ``hysteresis = h`` the scale is only lowered on the h-th overflow since the last
reset (DeepSpeed's ``delayed_shift``), and the hysteresis counter is reset when the scale is
raised (DeepSpeed's default ``consecutive_hysteresis=False``). bf16 and fp32 need no scaling: the
engine then uses `StaticLossScaler(1.0)`, whose `update` never skips anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered.config.schema import PrecisionConfig
from tiered.errors import LossScaleError  # raised here; still importable from here, where it used to live


class StaticLossScaler:
    """A fixed scale (1.0 for fp32/bf16, or fp16's ``loss_scale`` when it is not 0)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale must be > 0, got {scale!r} (fp16.loss_scale)")
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """A static scale never changes; an overflowing step is still skipped by the engine."""

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])


@dataclass
class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler. See [Note: loss scaling]."""

    scale: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0
    raise_at_min_scale: bool = True

    dynamic = True

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"initial loss scale must be > 0, got {self.scale} (fp16.initial_scale_power)")
        if self.window < 1:
            raise ValueError(f"fp16.loss_scale_window must be >= 1, got {self.window}")
        if self.hysteresis < 1:
            raise ValueError(f"fp16.hysteresis must be >= 1, got {self.hysteresis}")
        if not self.min_scale > 0:
            raise ValueError(f"fp16.min_loss_scale must be > 0, got {self.min_scale}")
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Called once per optimizer boundary, after the overflow check."""
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale and self.raise_at_min_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflowed with the loss scale already at its minimum "
                        f"({self.min_scale}); the model diverged or fp16 cannot represent it: lower the "
                        "learning rate, lower fp16.min_loss_scale, or train in bf16"
                    )
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                self.cur_hysteresis = self.hysteresis
                self.scale *= self.factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


LossScaler = StaticLossScaler | DynamicLossScaler


def build_loss_scaler(precision: PrecisionConfig) -> StaticLossScaler | DynamicLossScaler:
    """The scaler a resolved precision config asks for: dynamic only for fp16 with loss_scale 0."""
    import torch

    if precision.dtype != torch.float16:
        return StaticLossScaler(1.0)
    if precision.loss_scale and precision.loss_scale > 0:
        return StaticLossScaler(precision.loss_scale)
    return DynamicLossScaler(
        scale=2.0**precision.initial_scale_power,
        window=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
        min_scale=precision.min_loss_scale,
    )
