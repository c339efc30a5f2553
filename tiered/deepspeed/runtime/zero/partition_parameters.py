"""``deepspeed.runtime.zero.partition_parameters``: `Init`, `GatheredParameters` and `ZeroParamStatus`."""

from __future__ import annotations

from enum import Enum

from tiered.deepspeed.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]


class ZeroParamStatus(Enum):
    """DeepSpeed's states of a partitioned parameter (its ``ds_status``)."""

    AVAILABLE = 1  # gathered: the full value is in the parameter
    NOT_AVAILABLE = 2  # partitioned: the parameter is an empty placeholder
    INFLIGHT = 3  # being gathered
