"""``deepspeed.ops.adam.fused_adam.FusedAdam`` ([Note: DeepSpeed's Adam classes as tiered's])."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tiered.deepspeed.ops.adam.cpu_adam import refuse_unlike_adam

__all__ = ["FusedAdam"]


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's fused Adam/AdamW (``adam_w_mode=True``: decoupled weight decay), stepping as
    torch's Adam does on the parameters' own device."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        refuse_unlike_adam("FusedAdam", amsgrad=amsgrad, bias_correction=bias_correction)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled_weight_decay=adam_w_mode
        )
        for group in self.param_groups:
            group.setdefault("bias_correction", True)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
