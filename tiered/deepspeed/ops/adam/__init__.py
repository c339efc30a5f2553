"""``deepspeed.ops.adam``: `DeepSpeedCPUAdam` and `FusedAdam`, with DeepSpeed's arguments.

[Note: DeepSpeed's Adam classes as tiered's]
Scripts build DeepSpeed's Adam themselves (``DeepSpeedCPUAdam(model.parameters(), lr=...)``) and
pass it to ``deepspeed.initialize``, which translates any client Adam into tiered's offloaded Adam
(its lr, betas, eps, weight decay, Adam or AdamW, its groups: docs/deepspeed.md). So these classes
are torch optimizers with DeepSpeed's signatures and defaults (``adamw_mode=True`` /
``adam_w_mode=True``, ``weight_decay=0``), what the translation reads (``adam_w_mode``, the
groups), and a ``step()`` of their own for a script that steps one outside an engine:
`DeepSpeedCPUAdam` runs tiered's native CPU Adam (`tiered.optim.CPUAdam`, fp32 CPU parameters, as
DeepSpeed's), `FusedAdam` torch's Adam (decoupled weight decay in AdamW mode) on any device.
What DeepSpeed's would compute differently is refused by name: ``amsgrad``, ``bias_correction=False``
and ``fp32_optimizer_states=False``.
"""

from __future__ import annotations

from tiered.deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from tiered.deepspeed.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
