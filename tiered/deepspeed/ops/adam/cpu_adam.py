"""``deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam`` ([Note: DeepSpeed's Adam classes as tiered's])."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tiered.errors import UnsupportedConfigError
from tiered.optim.cpu_adam import CPUAdam

__all__ = ["DeepSpeedCPUAdam"]


def refuse_unlike_adam(cls: str, *, amsgrad: bool, bias_correction: bool) -> None:
    """The arguments of DeepSpeed's Adam classes that tiered's Adam would not honour."""
    if amsgrad:
        raise UnsupportedConfigError(f"{cls}(amsgrad=True): tiered's Adam has no AMSGrad; pass amsgrad=False")
    if not bias_correction:
        raise UnsupportedConfigError(
            f"{cls}(bias_correction=False): tiered's Adam always corrects the moments' bias; pass "
            "bias_correction=True"
        )


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's CPU Adam/AdamW (``adamw_mode=True``: decoupled weight decay), on tiered's kernel."""

    optimizer_id = 0

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        refuse_unlike_adam("DeepSpeedCPUAdam", amsgrad=amsgrad, bias_correction=bias_correction)
        if not fp32_optimizer_states:
            raise UnsupportedConfigError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False): tiered keeps Adam's moments in fp32 here; for "
                'compressed moments use the config\'s tiered.optimizer_state_format (e.g. "bf16") instead'
            )
        super().__init__(
            model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode
        )
        for group in self.param_groups:
            group.setdefault("bias_correction", True)
        self.adam_w_mode = adamw_mode
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
