"""Resolving "auto" values that depend on the model, as Hugging Face's DeepSpeed integration does.

[Note: auto from the model]
transformers' `HfTrainerDeepSpeedConfig.trainer_config_finalize` fills three ZeRO sizes from the
model's hidden size H: reduce_bucket_size = H*H, stage3_prefetch_bucket_size = int(0.9*H*H),
stage3_param_persistence_threshold = 10*H. tiered uses the same formulas so an HF config gives the
same numbers under both. H comes from `model.config` in HF's order: hidden_size, max(hidden_sizes),
then for a multimodal model its `text_config` (hidden_size, max(hidden_sizes)); then n_embd and
d_model (GPT-2 and T5 spellings HF's configs alias to hidden_size). A model without such a config
(a plain nn.Module) uses the largest `in_features` of its nn.Linear layers, which is H for any
transformer block (but not for a vision tower, hence text_config first).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiered.errors import ConfigError

HIDDEN_SIZE_FORMULAS: dict[str, tuple[str, Callable[[int], int]]] = {
    "zero_optimization.reduce_bucket_size": ("H*H", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": ("int(0.9*H*H)", lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": ("10*H", lambda h: 10 * h),
}
"""Keyed by the declared path of each key whose schema field says ``auto="model"`` (its aliases
resolve the same; tests/test_config_declared.py checks the two agree)."""


def hidden_size_of(model: torch.nn.Module) -> int | None:
    """The model's hidden size (see [Note: auto from the model]), or None if it has none."""
    config = getattr(model, "config", None)
    if config is not None:
        text = getattr(config, "text_config", None)
        sources = [
            (config, "hidden_size"),
            (config, "hidden_sizes"),
            (text, "hidden_size"),
            (text, "hidden_sizes"),
            (config, "n_embd"),
            (config, "d_model"),
        ]
        for owner, attr in sources:
            value = getattr(owner, attr, None) if owner is not None else None
            if isinstance(value, (list, tuple)) and value:
                value = max(value)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return max(widths) if widths else None


def resolve_from_model(path: str, model: torch.nn.Module | None, written: str | None = None) -> int:
    """The value of the model-dependent "auto" key `path` (its declared spelling; `written` is
    the spelling the config used, for the error messages)."""
    name = written or path
    if model is None:
        raise ConfigError(
            f'{name} is "auto", which is computed from the model\'s hidden size: pass model= to '
            "load_config (tiered.initialize does), or write a number"
        )
    hidden = hidden_size_of(model)
    if hidden is None:
        raise ConfigError(
            f'{name} is "auto" but the hidden size of {type(model).__name__} cannot be found '
            "(no config.hidden_size / n_embd / d_model and no nn.Linear layer); write a number"
        )
    return HIDDEN_SIZE_FORMULAS[path][1](hidden)
