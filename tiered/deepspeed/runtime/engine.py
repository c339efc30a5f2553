"""``deepspeed.runtime.engine``: `DeepSpeedEngine`, the class of the engine ``deepspeed.initialize``
returns here (for ``isinstance`` checks and type hints in ported code)."""

from __future__ import annotations

from tiered.deepspeed.engine_api import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
