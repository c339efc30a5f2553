"""What the engine ``deepspeed.initialize`` returns answers as DeepSpeed's where a ported script
tests the answer ([Note: DeepSpeed's answers on the engine initialize returns]).

[Note: DeepSpeed's answers on the engine initialize returns]
tiered's own API raises where a checkpoint is missing (``tiered.initialize(...).load_checkpoint``:
nothing silent). DeepSpeed's ``load_checkpoint(dir)`` without a tag returns ``(None, None)``, with
a warning, when ``dir`` has no ``latest`` file (no checkpoint saved yet, or no folder at all), and
scripts written for it test that (``if load_path is None: start fresh``). So the engine
``tiered.deepspeed.initialize`` returns does the same in that one case, warning as DeepSpeed does
and naming the newest complete checkpoint when there is one; an explicit tag that does not exist,
a ``latest`` naming an incomplete checkpoint, a corrupt or mismatched checkpoint still raise (in
DeepSpeed too, or worse). tiered.initialize's engines (its `Engine`, and the `DeepSpeedEngine` it
returns given DeepSpeed's keywords) are left as they are.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

from tiered.checkpoint.directory import find_latest_valid, read_latest
from tiered.deepspeed.engine_api import DeepSpeedEngine

log = logging.getLogger(__name__)

__all__ = ["as_deepspeed_engine"]


def _load_checkpoint(
    self: DeepSpeedEngine, load_dir: str | os.PathLike[str], tag: str | None = None, **kwargs: Any
) -> Any:
    if tag is None and (not os.path.isdir(load_dir) or read_latest(os.fspath(load_dir)) is None):
        newest = find_latest_valid(os.fspath(load_dir), verify=False) if os.path.isdir(load_dir) else None
        log.warning(
            "Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file exists "
            "or pass an explicit checkpoint tag when loading a checkpoint (DeepSpeed's answer: (None, None))%s",
            os.path.join(os.fspath(load_dir), "latest"),
            f"; the newest complete checkpoint there is {newest!r}" if newest else "",
        )
        return None, None
    return DeepSpeedEngine.load_checkpoint(self, load_dir, tag, **kwargs)


def as_deepspeed_engine(engine: DeepSpeedEngine) -> DeepSpeedEngine:
    """`engine` (the adapter around tiered's `Engine`), its answers made DeepSpeed's where the
    Note says; the `Engine` inside it keeps tiered's."""
    engine.load_checkpoint = types.MethodType(_load_checkpoint, engine)  # type: ignore[method-assign]
    return engine
