"""The keywords of ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (DeepSpeed's names and
meanings): what a load restores (`LoadScope`), and the tensors of a client_state.

[Note: checkpoint keywords]
``save_checkpoint(..., exclude_frozen_parameters=True)`` leaves out the shard groups of frozen
parameters (tiered never mixes frozen and trainable parameters in one group); the manifest says
so, and a load then keeps the engine's own frozen values. ``load_checkpoint`` takes DeepSpeed's
keywords: ``load_module_only=True`` restores the weights (the compute-dtype partition and the
fp32 master) and nothing else — no moments, counters, scheduler or loss scale;
``load_optimizer_states=False`` restores the weights and the counters but keeps Adam's moments
and its bias-correction step; ``load_lr_scheduler_states=False`` keeps the client scheduler's
state. One difference: the schedule of a config ``scheduler`` section is a function of Adam's
step count ([Note: scheduler step indexing]), so with one, loading the optimizer state without
the scheduler's (or the reverse) is refused, naming the two keywords, instead of silently
moving both. ``load_module_strict=False`` and ``custom_load_fn`` are refused (a checkpoint loads
whole into the model it was saved from).

A tensor in ``client_state`` goes into rank 0's safetensors file (``client_state.<i>``) and its
place in the JSON manifest holds ``{"__tensor__": "client_state.<i>"}``; the load puts the tensor
back. Everything else in client_state must be JSON (no pickle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tiered.errors import UnsupportedConfigError

TENSOR_KEY = "__tensor__"
WEIGHT_KINDS = frozenset({"param", "master"})


@dataclass(frozen=True)
class LoadScope:
    """What one `load_checkpoint` call restores (see [Note: checkpoint keywords])."""

    weights_only: bool = False
    """No optimizer moments (load_module_only or load_optimizer_states=False)."""
    training_state: bool = True
    """Counters and loss scale (False for load_module_only)."""
    optimizer_steps: bool = True
    """Adam's step counts (its bias correction, the config schedule's position)."""
    lr_scheduler: bool = True

    def keep(self, parts: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in parts.items() if k in WEIGHT_KINDS} if self.weights_only else parts


def load_scope(
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    custom_load_fn: Any,
    config_schedule: bool,
) -> LoadScope:
    if custom_load_fn is not None:
        raise UnsupportedConfigError(
            "load_checkpoint(custom_load_fn=...): tiered's checkpoints load partition by partition into the "
            "tiers; load the weights with engine.load_state_dict(...) or inside engine.gathered_parameters(...)"
        )
    if not load_module_strict:
        raise UnsupportedConfigError(
            "load_checkpoint(load_module_strict=False): a tiered checkpoint loads whole into the model it was "
            "saved from (a missing or extra parameter is an error naming it); load a partial state dict with "
            "engine.load_state_dict(sd, strict=False)"
        )
    if load_module_only:
        return LoadScope(weights_only=True, training_state=False, optimizer_steps=False, lr_scheduler=False)
    if config_schedule and load_optimizer_states != load_lr_scheduler_states:
        raise UnsupportedConfigError(
            f"load_checkpoint(load_optimizer_states={load_optimizer_states}, load_lr_scheduler_states="
            f"{load_lr_scheduler_states}) with a config scheduler section: its lr is a function of Adam's step "
            "count, which the two keywords would set apart; pass both True or both False (or load_module_only)"
        )
    return LoadScope(
        weights_only=not load_optimizer_states,
        optimizer_steps=load_optimizer_states,
        lr_scheduler=load_lr_scheduler_states,
    )


def split_client_state(
    state: Any, tensors: dict[str, torch.Tensor] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able client_state with each tensor replaced by its placeholder, the tensors by name)."""
    tensors = {} if tensors is None else tensors
    if isinstance(state, torch.Tensor):
        name = f"client_state.{len(tensors)}"
        tensors[name] = state.detach().to("cpu").contiguous()
        return {TENSOR_KEY: name}, tensors
    if isinstance(state, dict):
        return {k: split_client_state(v, tensors)[0] for k, v in state.items()}, tensors
    if isinstance(state, (list, tuple)):
        return [split_client_state(v, tensors)[0] for v in state], tensors
    return state, tensors


def join_client_state(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(state, dict):
        if set(state) == {TENSOR_KEY} and isinstance(state[TENSOR_KEY], str):
            return tensors[state[TENSOR_KEY]]
        return {k: join_client_state(v, tensors) for k, v in state.items()}
    if isinstance(state, list):
        return [join_client_state(v, tensors) for v in state]
    return state


def tensor_names(state: Any) -> list[str]:
    """The placeholders' tensor names in a saved client_state."""
    if isinstance(state, dict):
        if set(state) == {TENSOR_KEY} and isinstance(state[TENSOR_KEY], str):
            return [state[TENSOR_KEY]]
        return [n for v in state.values() for n in tensor_names(v)]
    if isinstance(state, list):
        return [n for v in state for n in tensor_names(v)]
    return []
