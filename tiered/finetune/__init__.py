"""Fine-tuning a local Hugging Face causal LM through tiered's engine: model building, data (text,
JSONL, chat, folders, datasets; packed into rows), LoRA, the activation check, the training loop and its plain-PyTorch reference.

Layer: above the engine, below the CLI (`tiered finetune`, the demo)."""

from __future__ import annotations

from tiered.config.overrides import apply_overrides  # where it lived before config/ had it
from tiered.finetune.data import ByteTokenizer, batches, load_tokens, tokenizer_for
from tiered.finetune.data_sources import Document, load_documents
from tiered.finetune.loop import (
    StepLog,
    TrainOptions,
    TrainResult,
    eval_loss,
    max_rel_diff,
    reference_train,
    train,
)
from tiered.finetune.lora import LoraSpec, apply_lora, parse_lora_spec
from tiered.finetune.model import ModelSource, build_model, load_hf_config, resolve_model
from tiered.finetune.packing import PackedBatches, PackedRows, eval_batches, pack, split_eval
from tiered.finetune.report import tier_table

__all__ = [
    "ByteTokenizer",
    "Document",
    "LoraSpec",
    "PackedBatches",
    "PackedRows",
    "apply_lora",
    "eval_batches",
    "eval_loss",
    "load_documents",
    "pack",
    "parse_lora_spec",
    "split_eval",
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
