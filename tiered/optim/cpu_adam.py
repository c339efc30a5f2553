"""CPUAdam: a torch.optim.Optimizer running the fused native Adam/AdamW on CPU tensors.

A drop-in for torch.optim.AdamW (adamw_mode=True), torch.optim.Adam with L2 weight decay
(adamw_mode=False) and DeepSpeedCPUAdam. Its state_dict has torch's layout (per parameter
``step`` as a float tensor, ``exp_avg``, ``exp_avg_sq``; torch's group keys), so a torch AdamW
state_dict loads into CPUAdam and a CPUAdam state_dict loads into torch AdamW.

[Note: bf16 optimizer states]
With ``bf16_states=True`` exp_avg and exp_avg_sq are stored in bfloat16 (half the state memory
and traffic; the update itself still runs in fp32, rounding the states to nearest even on store).
This is an approximation of fp32 Adam, close but not equal to it; loaded fp32 states are
converted on the next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

import tiered_ext

_EXTRA_GROUP_KEYS = ("adamw_mode", "bf16_states")


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"CPUAdam: lr must be a finite number >= 0, got {lr!r}")
    if len(betas) != 2:
        raise ValueError(f"CPUAdam: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not (0.0 <= beta < 1.0):
            raise ValueError(f"CPUAdam: betas[{i}] must be in [0, 1), got {beta!r}")
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"CPUAdam: eps must be a finite number > 0, got {eps!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"CPUAdam: weight_decay must be a finite number >= 0, got {weight_decay!r}")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over float32 CPU parameters with the fused native kernel (tiered_ext.adam_step)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bf16_states: bool = False,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        # torch's own group keys too, so a state_dict round-trips through torch.optim.AdamW unchanged.
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
            foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=adamw_mode,
            adamw_mode=adamw_mode, bf16_states=bf16_states,
        )  # fmt: skip
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A torch AdamW/Adam state_dict has no adamw_mode/bf16_states: keep ours (load_state_dict
        # replaces whole groups by the saved ones).
        super().__setstate__(state)
        for group in self.param_groups:
            for key in _EXTRA_GROUP_KEYS:
                group.setdefault(key, self.defaults[key])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError(
                    f"CPUAdam: param_groups[{gi}] asks for amsgrad/maximize, which CPUAdam does not do"
                )
            beta1, beta2 = group["betas"]
            _check_hyper(group["lr"], (beta1, beta2), group["eps"], group["weight_decay"])
            state_dtype = torch.bfloat16 if group["bf16_states"] else torch.float32
            todo = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format, dtype=state_dtype
                    )
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format, dtype=state_dtype
                    )
                for key in ("exp_avg", "exp_avg_sq"):
                    if state[key].dtype != state_dtype or not state[key].is_contiguous():
                        state[key] = state[key].to(dtype=state_dtype).contiguous()
                todo.append((gi, pi, p, state))
            if not todo:
                continue
            # One dispatch for every step counter of the group, as torch's foreach/fused AdamW do;
            # per-parameter tensor ops would cost more than the kernel on small parameters.
            steps = [t[3]["step"] for t in todo]
            torch._foreach_add_(steps, 1.0)
            step_values = torch.stack(steps).tolist()
            hyper: dict[str, Any] = dict(
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["adamw_mode"]),
            )  # fmt: skip
            try:
                tiered_ext._adam_step_many(
                    [t[2] for t in todo], [t[2].grad for t in todo], [t[3]["exp_avg"] for t in todo],
                    [t[3]["exp_avg_sq"] for t in todo], steps=[int(s) for s in step_values], flat=False, **hyper,
                )  # fmt: skip
            except (ValueError, TypeError):
                # The binding refused before touching any tensor, so none of them stepped: say which
                # parameter and why ([Note: two-layer argument checks] in tiered_ext/__init__.py).
                torch._foreach_sub_(steps, 1.0)
                for gi_, pi, p, _ in todo:
                    self._check_param(p, gi_, pi)
                raise
        return loss

    @staticmethod
    def _check_param(p: torch.Tensor, gi: int, pi: int) -> None:
        where = f"CPUAdam: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
        if p.device.type != "cpu":
            raise ValueError(
                f"{where} is on {p.device}; CPUAdam updates CPU tensors (use torch.optim.AdamW on GPU)"
            )
        if p.dtype != torch.float32:
            raise ValueError(f"{where} is {p.dtype}; CPUAdam updates float32 (master) parameters")
        grad = p.grad
        assert grad is not None, where  # the step checks only parameters that have a gradient
        if grad.is_sparse:
            raise ValueError(f"{where} has a sparse gradient; CPUAdam needs dense gradients")
        if not p.is_contiguous() or not grad.is_contiguous():
            raise ValueError(f"{where} or its gradient is not contiguous; call .contiguous() on it first")
        if grad.dtype != torch.float32:
            raise ValueError(f"{where} has a {grad.dtype} gradient; expected float32")
