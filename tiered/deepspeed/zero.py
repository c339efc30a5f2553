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
partitions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from tiered.engine.build import managed_models
from tiered.errors import ConfigError, UnsupportedConfigError
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
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        if cfg is not None:
            from tiered.config.loader import read_config_file

            raw = cfg if isinstance(cfg, dict) else read_config_file(cfg)
            stage = (raw.get("zero_optimization") or {}).get("stage", 3)
            if stage not in (3, "auto"):
                raise ConfigError(
                    f"zero.Init: the config's zero_optimization.stage is {stage}; zero.Init partitions "
                    "parameters at construction, which is ZeRO stage 3"
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

    def __enter__(self) -> Init:
        if self.enabled:
            self._meta = torch.device("meta")
            self._meta.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._meta is not None:
            self._meta.__exit__(exc_type, exc, tb)
            self._meta = None


def _as_list(params: Any) -> list[torch.nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    if isinstance(params, Iterable):
        return list(params)
    raise TypeError(f"GatheredParameters: expected a parameter or parameters, got {type(params).__name__}")


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
