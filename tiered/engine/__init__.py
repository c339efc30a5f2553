"""`tiered.initialize(model, config) -> Engine`: config, tiers, ZeRO-3 partitions, offloaded Adam.

The engine is built in `tiered.engine.build` (its `EngineParts`, then the `Engine` over them);
DeepSpeed's engine API is an adapter around it in `tiered.deepspeed`."""

from __future__ import annotations

from tiered.engine.build import Placement, initialize
from tiered.engine.engine import Engine
from tiered.engine.parts import EngineHooks, EngineParts
from tiered.engine.pretrained import from_pretrained

__all__ = ["Engine", "EngineHooks", "EngineParts", "Placement", "from_pretrained", "initialize"]
