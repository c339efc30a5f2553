"""What tiered deliberately lacks of DeepSpeed's API, and the error a script gets when it reaches it.

[Note: refused DeepSpeed features]
DeepSpeed ships features tiered does not implement, on purpose: pipeline parallelism
(``deepspeed.pipe``, ``runtime.pipe``), tensor parallelism (AutoTP, ``tp_model_init``,
``module_inject``), sequence parallelism (``deepspeed.sequence``) and DeepSpeed-Inference
(``init_inference``). A script that reaches one must learn that at once, by name, with what to do
instead, never through an ``AttributeError`` or a ``No module named`` that reads like a broken
install. So each feature's modules raise `UnsupportedFeatureError` when imported (the import
finder of [Note: deepspeed as an alias of tiered.deepspeed] knows their prefixes), and the names
scripts reach through the top-level module (``deepspeed.PipelineModule``, ``init_inference``)
are classes and functions that raise it when constructed or called, so that ``isinstance`` checks
in ported code still work. The error is an ``ImportError`` too: a script that falls back when the
import fails takes its fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from tiered.errors import UnsupportedFeatureError

__all__ = ["FEATURES", "feature_of_module", "refuse", "refusing_class"]


@dataclass(frozen=True)
class Feature:
    what: str
    instead: str


FEATURES: dict[str, Feature] = {
    "pipeline": Feature(
        "pipeline parallelism (deepspeed.pipe.PipelineModule, runtime.pipe.PipelineEngine, train_batch)",
        "tiered trains the whole model on every rank with ZeRO-3 (each rank holds a shard of every layer's "
        "parameters, gathered layer by layer): build the layers as one nn.Module (nn.Sequential of them), pass it "
        "to deepspeed.initialize and train with engine(batch), engine.backward(loss), engine.step()",
    ),
    "tensor": Feature(
        "tensor parallelism (AutoTP, deepspeed.tp_model_init, module_inject, a tensor_parallel section)",
        "ZeRO-3 partitions every parameter over the data-parallel ranks instead, and offloads what does not fit "
        "to CPU memory or NVMe: drop the tensor-parallel call and give the whole model to deepspeed.initialize",
    ),
    "sequence": Feature(
        "sequence parallelism (deepspeed.sequence, Ulysses)",
        "train with sequences that fit one rank (activation checkpointing keeps long ones small: "
        "deepspeed.checkpointing.checkpoint, or the model's gradient_checkpointing_enable())",
    ),
    "inference": Feature(
        "DeepSpeed-Inference (deepspeed.init_inference, InferenceEngine, kernel injection)",
        "tiered is a training engine: save the trained model (engine.save_16bit_model(dir) or "
        "engine.save_pretrained(dir)) and run it with plain PyTorch or transformers' from_pretrained",
    ),
}

MODULE_PREFIXES: dict[str, str] = {
    "deepspeed.pipe": "pipeline",
    "deepspeed.runtime.pipe": "pipeline",
    "deepspeed.module_inject": "tensor",
    "deepspeed.runtime.tensor_parallel": "tensor",
    "deepspeed.sequence": "sequence",
    "deepspeed.runtime.sequence_parallel": "sequence",
    "deepspeed.inference": "inference",
    "deepspeed.model_implementations": "inference",
}
"""DeepSpeed's modules of each refused feature: importing one (or any module under it) raises."""


def message(feature: str, used: str) -> str:
    f = FEATURES[feature]
    return f"{used}: tiered does not implement {f.what}. Instead: {f.instead} (docs/deepspeed.md, 'What is not there')"


def feature_of_module(name: str) -> str | None:
    """The refused feature DeepSpeed's module `name` belongs to, None for any other module."""
    for prefix, feature in MODULE_PREFIXES.items():
        if name == prefix or name.startswith(prefix + "."):
            return feature
    return None


def refuse(feature: str, used: str) -> NoReturn:
    raise UnsupportedFeatureError(message(feature, used))


def refusing_class(name: str, feature: str, module: str) -> type:
    """A class called `name` whose construction raises the feature's error (isinstance works)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        refuse(feature, f"deepspeed.{name}(...)")

    return type(name, (), {"__init__": __init__, "__module__": module, "__doc__": message(feature, name)})
