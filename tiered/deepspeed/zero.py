"""``deepspeed.zero``: `Init` (build a model partitioned from the start) and `GatheredParameters`.

[Note: zero.Init on the meta device]
DeepSpeed's ``zero.Init`` partitions each parameter as its module is constructed, so a model
larger than one device's (or the host's) memory is never whole anywhere. tiered reaches the same
end through the meta device: inside ``Init`` modules are built under ``torch.device("meta")``
(shapes only, no storage); ``initialize`` then gives each shard group's parameters real storage
just long enough to initialise them (the root model's ``_init_weights``, else each module's
``reset_parameters``) and copy them into the group's partition ([Note: meta materialisation]),
so peak host memory for parameters is about one group. The difference: the values are drawn at
initialize, group by group, not at construction, so the same seed gives other initial values than
a model built outside ``Init`` (DeepSpeed's equal them). Load trained weights with
``tiered.initialize(..., weights=folder)`` or ``engine.load_state_dict``. The config (``config_dict_or_path``)
is read and checked here; it decides nothing yet: the one passed to ``initialize`` places the
partitions. A model built inside ``Init`` and run before ``initialize`` would compute on
parameters that have no values (torch's "Tensor on device meta" error, or meta outputs from meta
inputs); so the modules built in the block are noted (torch's module and parameter registration
hooks, for the block's duration only) and each root among them refuses to run, naming the fix,
until an engine holds it or its parameters have values.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from tiered.engine.lifetime import managed_models
from tiered.errors import ConfigError, ModelNotInitializedError, UnsupportedConfigError, UsageError
from tiered.zero import set_leaf_modules

if TYPE_CHECKING:
    from tiered.engine import Engine

log = logging.getLogger(__name__)

__all__ = ["GatheredParameters", "Init", "engine_of", "set_leaf_modules"]


class Init:
    """``with deepspeed.zero.Init(config_dict_or_path=ds_config): model = Model()`` — see
    [Note: zero.Init on the meta device]. `enabled=False` builds normally; `module=` (an existing
    model) is left as it is: initialize partitions it. Placement arguments (`remote_device`,
    `pin_memory`, `dtype`) belong to the config initialize takes and are refused here."""

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **unsupported: Any,
    ) -> None:
        if config_dict_or_path is not None and config is not None:
            raise ConfigError("zero.Init: pass config_dict_or_path= or config= (its old name), not both")
        _check_init_config(
            config_dict_or_path if config_dict_or_path is not None else config,
            "config_dict_or_path" if config_dict_or_path is not None else "config",
        )
        refused = {
            k: v
            for k, v in {"remote_device": remote_device, "dtype": dtype, "mpu": mpu, **unsupported}.items()
            if v is not None and v is not False
        }
        if pin_memory:
            refused["pin_memory"] = pin_memory
        if refused:
            raise UnsupportedConfigError(
                f"zero.Init({', '.join(f'{k}={v!r}' for k, v in refused.items())}): tiered places and casts the "
                "partitions from the config passed to initialize (offload_param, bf16/fp16); remove these here"
            )
        self.enabled = enabled and module is None
        self._meta: AbstractContextManager[Any] | None = None
        self._built: _BuiltModules | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._built = _BuiltModules()
            self._meta = torch.device("meta")
            self._meta.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._meta is not None:
            self._meta.__exit__(exc_type, exc, tb)
            self._meta = None
        if self._built is not None:
            self._built.close(guard=exc_type is None)
            self._built = None


_INIT_FORM = (
    "DeepSpeed's form: deepspeed.zero.Init(config_dict_or_path=ds_config), ds_config the dict or JSON "
    "file path later passed to deepspeed.initialize"
)


def _check_init_config(cfg: Any, arg: str) -> None:
    """zero.Init's config: a dict or a JSON file path, whose ZeRO stage is 3 (what it means);
    read and checked here, nothing else in it decides anything yet."""
    if cfg is None:
        return
    if isinstance(cfg, (str, os.PathLike)):
        from tiered.config.loader import read_config_file

        raw = read_config_file(cfg)
    elif isinstance(cfg, dict):
        raw = cfg
    else:
        raise UsageError(
            f"zero.Init({arg}={cfg!r}): a config is a dict or the path of a JSON file ({_INIT_FORM})"
        )
    zero = raw.get("zero_optimization")
    if zero is not None and not isinstance(zero, dict):
        raise ConfigError(
            f"zero.Init({arg}=...): zero_optimization is {zero!r}, not a JSON object; write e.g. "
            '{"zero_optimization": {"stage": 3}} (' + _INIT_FORM + ")"
        )
    stage = (zero or {}).get("stage", 3)
    if isinstance(stage, bool) or stage not in (3, "auto"):
        raise ConfigError(
            f"zero.Init({arg}=...): the config's zero_optimization.stage is {stage!r}; zero.Init partitions "
            "parameters at construction, which is ZeRO stage 3 (the number 3)"
        )


class _BuiltModules:
    """The modules built inside one zero.Init (the ones that registered a parameter or a child
    there), seen through torch's global registration hooks for as long as the block runs; at its
    end each root among them gets a forward pre-hook that refuses to run it while its parameters
    are still on the meta device and no engine holds it ([Note: zero.Init on the meta device])."""

    def __init__(self) -> None:
        from torch.nn.modules import module as nn_module

        self.modules: list[weakref.ref[torch.nn.Module]] = []
        self.children: set[int] = set()
        seen: set[int] = set()

        def note(owner: torch.nn.Module) -> None:
            if id(owner) not in seen:
                seen.add(id(owner))
                self.modules.append(weakref.ref(owner))

        def on_param(owner: torch.nn.Module, name: str, param: Any) -> None:
            note(owner)

        def on_child(owner: torch.nn.Module, name: str, child: Any) -> None:
            note(owner)
            if isinstance(child, torch.nn.Module):
                self.children.add(id(child))

        self._hooks = [
            nn_module.register_module_parameter_registration_hook(on_param),
            nn_module.register_module_module_registration_hook(on_child),
        ]

    def close(self, *, guard: bool) -> None:
        for h in self._hooks:
            h.remove()
        if not guard:
            return
        for ref in self.modules:
            m = ref()
            if m is not None and id(m) not in self.children:
                _RefuseBeforeInitialize(m)


class _RefuseBeforeInitialize:
    """The forward pre-hook of a module built under zero.Init: removed at the first forward that
    finds an engine holding it (or its parameters with values), so it costs nothing after."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        params = list(module.parameters())
        if any(p.device.type == "meta" for p in params) and engine_of(params) is None:
            raise _not_initialized(module)
        self.handle.remove()


def _not_initialized(module: torch.nn.Module) -> ModelNotInitializedError:
    return ModelNotInitializedError(
        f"{type(module).__name__} was built under deepspeed.zero.Init: its parameters are on the meta device "
        "(shapes, no values) until initialize gives them values; run it through the engine: engine, *_ = "
        "deepspeed.initialize(model=model, config=ds_config), then engine(batch) (DeepSpeed's form too)"
    )


_GATHER_FORM = (
    "DeepSpeed's form: GatheredParameters(model.layer.weight) or GatheredParameters(list(model.parameters()), "
    "modifier_rank=0); a parameter by name is dict(model.named_parameters())['layer.weight']"
)


def _as_list(params: Any) -> list[torch.nn.Parameter]:
    """The parameters `params` names: one, a module's, or an iterable of them; anything else (a
    name, a number) is a UsageError naming DeepSpeed's form."""
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    if isinstance(params, Iterable) and not isinstance(params, (str, bytes, Mapping)):
        found = list(params)
        wrong = next((p for p in found if not isinstance(p, torch.Tensor)), None)
        if wrong is None:
            return found
        raise UsageError(
            f"GatheredParameters(params=[..., {wrong!r}, ...]): every item is a parameter ({_GATHER_FORM})"
        )
    raise UsageError(
        f"GatheredParameters(params={params!r}): params is a parameter or parameters ({_GATHER_FORM})"
    )


def engine_of(params: Iterable[torch.Tensor]) -> Engine | None:
    """The open engine whose model holds `params` (None: none does); parameters of two engines
    in one call are an error."""
    ids = {id(p) for p in params}
    found = []
    for model, engine in managed_models():
        if ids & {id(p) for p in model.parameters()}:
            found.append(engine)
    if len(found) > 1:
        raise ConfigError(
            "GatheredParameters: the parameters belong to models of two engines; gather each apart"
        )
    return found[0] if found else None  # type: ignore[return-value]


class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters(params, modifier_rank=None)``: inside, the
    parameters hold their full values; with `modifier_rank` (0) what rank 0 holds at exit is
    written back to every rank's partitions and the fp32 master ([Note: gathered parameters]).
    Parameters no engine manages (before initialize) are left as they are, as DeepSpeed leaves
    parameters it did not partition. Every rank enters it."""

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None:
            raise UnsupportedConfigError(
                "GatheredParameters(fwd_module=...): tiered has no external-parameter registration; a "
                "parameter used by another module's forward is gathered by that module's group"
            )
        if modifier_rank is not None and (
            isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
        ):
            raise UsageError(
                f"GatheredParameters(modifier_rank={modifier_rank!r}): a rank is an int or None ({_GATHER_FORM})"
            )
        if modifier_rank not in (None, 0):
            raise UnsupportedConfigError(
                f"GatheredParameters(modifier_rank={modifier_rank}): tiered writes back rank 0's values; "
                "modify on rank 0 (modifier_rank=0)"
            )
        self.params = _as_list(params) if enabled else []
        meta = [p for p in self.params if p.device.type == "meta"]
        if meta and engine_of(self.params) is None:
            raise ConfigError(
                "GatheredParameters: the parameters are on the meta device (built under zero.Init) and no "
                "engine holds them yet: call initialize first (it initialises and partitions them)"
            )
        self.modify = modifier_rank is not None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        engine = engine_of(self.params) if self.params else None
        if engine is not None:
            self._stack.enter_context(engine.gathered_parameters(self.params, modify=self.modify))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return self._stack.__exit__(exc_type, exc, tb)
