"""Fine-tuning a local Hugging Face causal LM through tiered's engine: model building, text data
(with a built-in byte tokenizer), the training loop and its plain-PyTorch reference.

Layer: above the engine, below the CLI (`tiered finetune`, the demo)."""

from __future__ import annotations

from tiered.finetune.data import ByteTokenizer, batches, load_tokens, tokenizer_for
from tiered.finetune.loop import (
    StepLog,
    TrainOptions,
    TrainResult,
    apply_overrides,
    max_rel_diff,
    reference_train,
    train,
)
from tiered.finetune.model import ModelSource, build_model, load_hf_config, resolve_model
from tiered.finetune.report import tier_table

__all__ = [
    "ByteTokenizer",
    "ModelSource",
    "StepLog",
    "TrainOptions",
    "TrainResult",
    "apply_overrides",
    "batches",
    "build_model",
    "load_hf_config",
    "load_tokens",
    "max_rel_diff",
    "reference_train",
    "resolve_model",
    "tier_table",
    "tokenizer_for",
    "train",
]
