"""The rest of DeepSpeed's engine API, for ported scripts: `Engine` inherits `DeepSpeedEngineAPI`.

Each method keeps DeepSpeed's meaning (deepspeed/runtime/engine.py); where tiered differs it
says so. The lr plumbing of client optimizers and schedulers is [Note: the optimizer facade].
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tiered.engine.facade import TieredOptimizer
    from tiered.engine.nonfinite import NonFiniteGuard
    from tiered.zero import ZeroParameters


class DeepSpeedEngineAPI:
    """Mixed into `Engine`; uses its module, zero, gas and step bookkeeping."""

    _module: torch.nn.Module
    gas: int
    zero: ZeroParameters
    _found_inf: bool
    _sq_norm_local: float
    nonfinite: NonFiniteGuard
    _backward_since_step: bool
    last_grad_norm: float | None
    facade: TieredOptimizer | None = None
    lr_scheduler: Any = None
    _step_applied: bool = False
    _lr_scales: tuple[float, ...] = (1.0,)
    """Each param group's lr as a multiple of the base lr the optimizer steps with."""

    def train(self, mode: bool = True) -> Any:
        """The module's train mode (dropout on), as ``nn.Module.train``; returns the engine."""
        self._module.train(mode)
        return self

    def eval(self) -> Any:
        self._module.eval()
        return self

    @property
    def training(self) -> bool:
        return self._module.training

    @property
    def device(self) -> torch.device:
        """Where the model computes (DeepSpeed: this rank's accelerator device)."""
        return self.zero.device

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's LOCAL_RANK; 0 for one process)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (inf after an fp16
        overflow). None before the first step, and where nothing needed it: tiered computes
        the norm only for gradient_clipping > 0 or fp16 (DeepSpeed always does)."""
        norm = self.last_grad_norm
        return None if norm is None or norm != norm else norm

    def was_step_applied(self) -> bool:
        """True if the last `step()` updated the parameters: False inside an accumulation window
        and after an fp16 overflow (DeepSpeed's meaning)."""
        return self._step_applied

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last optimizer step. `step()` already zeroes
        them at every boundary (as DeepSpeed's), so a loop calling this after it is harmless."""
        self.zero.zero_grads()
        self._found_inf = False
        self._sq_norm_local = 0.0
        self._backward_since_step = False
        self.nonfinite.reset()

    # ---- lr plumbing ([Note: the optimizer facade]) ------------------------------------------
    def _after_applied_step(self) -> None:
        if self.lr_scheduler is not None:
            with warnings.catch_warnings():
                # torch warns that the client optimizer never stepped: the engine stepped instead
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step")
                self.lr_scheduler.step()
        elif self.facade is not None:
            for g, lr in zip(self.facade.param_groups, self.get_lr(), strict=True):  # type: ignore[attr-defined]
                g["lr"] = lr

    def _client_training_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.facade is not None:
            state["param_group_lrs"] = [float(g["lr"]) for g in self.facade.param_groups]
        return state

    def _apply_client_training_state(self, state: dict[str, Any]) -> None:
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            groups = self.lr_scheduler.optimizer.param_groups
            for g, lr in zip(groups, self.lr_scheduler.get_last_lr(), strict=True):
                g["lr"] = lr
        if self.facade is not None and state.get("param_group_lrs") is not None:
            for g, lr in zip(self.facade.param_groups, state["param_group_lrs"], strict=True):
                g["lr"] = lr
