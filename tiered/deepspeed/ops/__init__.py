"""``deepspeed.ops``: the optimizers DeepSpeed scripts build themselves (``ops.adam``)."""

from __future__ import annotations

from tiered.deepspeed.ops import adam

__all__ = ["adam"]
