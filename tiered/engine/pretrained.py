"""`tiered.from_pretrained(folder, config) -> Engine`: a Hugging Face causal LM built on the meta
device and its safetensors weights streamed into the tiers ([Note: streaming load])."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from tiered.config.schema import TieredConfig
from tiered.engine.build import initialize
from tiered.engine.engine import Engine
from tiered.errors import ConfigError, TieredError

log = logging.getLogger(__name__)


def read_generation_config(model: torch.nn.Module, folder: str | os.PathLike[str] | None) -> None:
    """Give `model` the folder's generation_config.json, as transformers' from_pretrained does
    (a model built from its config alone would carry only the config's defaults, and its export
    would lose, say, a chat model's list of stop tokens)."""
    if folder is None or not (Path(folder) / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("%s/generation_config.json not used (the config's defaults are): %s", folder, exc)
        return
    model.generation_config = gen  # type: ignore[assignment]  # a PreTrainedModel attribute


def meta_causal_lm(folder: str | os.PathLike[str], *, attn_implementation: str = "eager") -> torch.nn.Module:
    """The causal LM of `folder`'s config.json (AutoModelForCausalLM's class, or a wrapped
    multimodal model with its other towers frozen: [Note: wrapped models train their language
    model]), on the meta device (no host memory). Eager attention by default: the same math on
    every machine."""
    try:
        import transformers  # noqa: F401 - present, or the error below says how to install it
    except ImportError as exc:
        raise TieredError(
            "from_pretrained needs transformers; install it with pip install 'tiered[hf]'"
        ) from exc
    from tiered.planning.hf_config import load_hf_config, resolve_model

    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"from_pretrained({folder}): not a folder; pass a Hugging Face model folder")
    # read and checked as every model folder is ([Note: files a user names], [Note: plausible model sizes])
    hf = load_hf_config(resolve_model(path, weights=False, flag="from_pretrained"))
    from tiered.planning.text_model import causal_lm_class, freeze_other_towers

    cls: Any = causal_lm_class(hf, str(path))  # [Note: wrapped models train their language model]
    with torch.device("meta"):
        model: torch.nn.Module = cls._from_config(
            hf, attn_implementation=attn_implementation, dtype=torch.float32
        )
    freeze_other_towers(model)
    read_generation_config(model, path)
    return model.train()


def from_pretrained(
    folder: str | os.PathLike[str],
    config: dict[str, Any] | str | os.PathLike[str] | TieredConfig,
    *,
    init_missing: bool = False,
    attn_implementation: str = "eager",
    process_group: Any = None,
    **hyperparameters: Any,
) -> Engine:
    """Build `folder`'s causal LM on the meta device and stream its weights into the tiers;
    the engine (`engine.module` is the model). Arguments as `tiered.initialize`."""
    model = meta_causal_lm(folder, attn_implementation=attn_implementation)
    return initialize(
        model,
        config,
        process_group=process_group,
        weights=folder,
        init_missing=init_missing,
        **hyperparameters,
    )
