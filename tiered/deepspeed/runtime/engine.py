"""``deepspeed.runtime.engine``: `DeepSpeedEngine`, the class of the engine ``deepspeed.initialize``
returns here (for ``isinstance`` checks and type hints in ported code)."""

from __future__ import annotations

from tiered.engine import Engine

DeepSpeedEngine = Engine
"""tiered's engine: what ``deepspeed.initialize`` returns first. Build one with initialize, not by
calling the class with DeepSpeed's constructor arguments."""

__all__ = ["DeepSpeedEngine"]
