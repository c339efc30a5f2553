"""The optimizer a ported DeepSpeed script (or Hugging Face's Trainer) holds: a thin facade.

[Note: the optimizer facade]
DeepSpeed returns its ZeRO optimizer, and scripts (and Hugging Face's / accelerate's DeepSpeed
integration) build an lr scheduler on it: the scheduler writes ``param_groups[i]["lr"]`` and the
engine steps with it. tiered's optimizer is the engine's `OffloadedAdam`, which has no torch
param groups, so `TieredOptimizer` is a `torch.optim.Optimizer` holding only the groups (the
model's parameters and each group's lr and weight decay) and no state. Whoever drives the lr
writes its groups: a client scheduler (built on this facade, or on the client optimizer it
replaced, whose groups the engine then reads), or the engine itself after each step when the
config's ``scheduler`` section drives it. Before every step the engine reads the groups' lrs
(`ClientLR`), divides each by its group's lr scale and requires them to agree: one base lr per
step, as the offloaded Adam's per-parameter ``lr_scale`` is fixed (a schedule that moves groups
by different factors is refused, naming the groups). ``step()`` does nothing once the engine
stepped (accelerate's wrapper calls it after ``engine.step()``) and is an error otherwise;
``state_dict()`` holds the groups' hyper-parameters only: the optimizer state is in the engine's
checkpoint (``engine.save_checkpoint``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tiered.engine import Engine


class TieredOptimizer(torch.optim.Optimizer):
    """Param groups without state; see [Note: the optimizer facade]."""

    def __init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        super().__init__(groups, defaults)
        self.engine: Engine | None = None
        """The engine it stands for, from `attach` on."""
        self._steps_seen = 0

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self._steps_seen = engine.global_steps

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        engine = self.engine
        if engine is None or engine.global_steps == self._steps_seen:
            raise RuntimeError(
                "the optimizer returned by tiered.deepspeed.initialize does not step by itself: call "
                "engine.step() after every engine.backward(loss) (it steps at the accumulation boundary)"
            )
        self._steps_seen = engine.global_steps

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.engine is not None:
            self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {
            "state": {},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("param_groups", [])
        if len(saved) != len(self.param_groups):
            raise ValueError(f"{len(saved)} saved param groups for {len(self.param_groups)}")
        for g, s in zip(self.param_groups, saved, strict=True):
            g.update({k: v for k, v in s.items() if k != "params"})


class ClientLR:
    """The lr the engine steps with, read from param groups a client drives (see the Note)."""

    def __init__(self, groups: list[dict[str, Any]], scales: list[float]) -> None:
        if len(groups) != len(scales):
            raise ValueError(
                f"the lr scheduler's optimizer has {len(groups)} param groups, the engine {len(scales)}; "
                "build the scheduler on the optimizer passed to (or returned by) initialize"
            )
        self.groups = groups
        self.scales = scales

    def lr_at(self, step: int) -> float:
        base: float | None = None
        for i, (g, s) in enumerate(zip(self.groups, self.scales, strict=True)):
            lr = float(g["lr"])
            if s == 0:
                continue
            if base is None:
                base = lr / s
            elif not math.isclose(lr / s, base, rel_tol=1e-6, abs_tol=1e-12):
                raise ValueError(
                    f"param group {i} has lr {lr:g}, but group 0's schedule implies {base * s:g}: the lr "
                    "scheduler moves groups by different factors, which tiered's Adam does not support "
                    "(each group's lr must stay a fixed multiple of the base lr)"
                )
        return 0.0 if base is None else base

    def lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.groups]


class ConfigLRScheduler:
    """DeepSpeed's lr scheduler object for a config ``scheduler`` section (``WarmupLR``, ...), the
    fourth item of initialize's tuple and ``engine.lr_scheduler``: a view of the engine's
    schedule, which is a function of the optimizer steps taken ([Note: scheduler step
    indexing]). The engine advances it after every applied step, as DeepSpeed's engine steps its
    scheduler; it cannot be stepped by hand (DeepSpeed would then skip ahead, tiered refuses)."""

    def __init__(self, name: str, lrs: Callable[[], list[float]], steps_taken: Callable[[], int]) -> None:
        self.name = name
        self._lrs = lrs
        self._steps_taken = steps_taken

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: the optimizer steps taken, minus one (-1 before the first)."""
        return self._steps_taken() - 1

    def get_last_lr(self) -> list[float]:
        """The lr of each param group for the next step (what DeepSpeed's scheduler last set)."""
        return self._lrs()

    def get_lr(self) -> list[float]:
        return self._lrs()

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"the config's {self.name} scheduler is stepped by engine.step() (after every applied optimizer "
            "step, as DeepSpeed's engine does); do not step it yourself: the lr would skip ahead in DeepSpeed "
            "and tiered refuses"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The position is the engine's (restored by ``engine.load_checkpoint``): a state that
        disagrees with it is an error, never a silent jump."""
        saved = state_dict.get("last_batch_iteration")
        if saved != self.last_batch_iteration:
            raise ValueError(
                f"{self.name}: last_batch_iteration {saved!r} in the state, {self.last_batch_iteration} in "
                "the engine; the schedule's position is the engine's optimizer step count: restore it with "
                "engine.load_checkpoint"
            )

    def __repr__(self) -> str:
        return f"{self.name}(last_batch_iteration={self.last_batch_iteration}, lr={self.get_last_lr()})"
