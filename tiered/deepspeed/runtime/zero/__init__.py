"""``deepspeed.runtime.zero`` (DeepSpeed's ``deepspeed.zero``): `Init`, `GatheredParameters`, and
the submodules scripts import them from (``partition_parameters``)."""

from __future__ import annotations

from tiered.deepspeed.runtime.zero import partition_parameters
from tiered.deepspeed.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
