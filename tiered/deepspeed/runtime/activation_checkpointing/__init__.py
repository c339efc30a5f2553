"""``deepspeed.runtime.activation_checkpointing`` (``deepspeed.checkpointing``)."""

from __future__ import annotations

from tiered.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
