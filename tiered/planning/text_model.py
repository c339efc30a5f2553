"""Which transformers class a model folder is built as, and, for a wrapped (multimodal) model,
which part of it trains on text.

[Note: wrapped models train their language model]
Gemma 3 as its 4B/12B/27B checkpoints ship is ``Gemma3ForConditionalGeneration``: a vision tower,
a projector and the language model, the text config nested under ``text_config`` (so
``config.vocab_size`` does not exist). Llava, Mistral 3, Qwen2-VL and the other
``*ForConditionalGeneration`` folders have the same shape. Fine-tuned on text, such a model
trains its language model and output head; the other towers get no gradient from text, so they
are frozen (no gradient partition, no optimizer state: [Note: frozen parameters]) but kept: they
are loaded, partitioned and exported with the rest, so the exported folder loads as the
original class. The class is the one transformers' ``AutoModelForCausalLM`` builds (Gemma 3's
wrapper included); where it builds none, the folder's ``architectures[0]`` when that is a
transformers ``*ForConditionalGeneration`` (else the image-text-to-text class of the model type).
The language model is the outermost sub-model built from the text config (its ``config`` *is*
``config.get_text_config()``), the head is ``get_output_embeddings()``; sizes a text run needs
(vocabulary, layers, hidden size) are read from the text config. A wrapper without such a
sub-model, or an encoder-decoder (T5, Whisper, BART: a text run of a decoder-only model is what
tiered fine-tunes), is refused by `tiered plan` and `tiered finetune` alike, naming the class.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from tiered.errors import ConfigError

log = logging.getLogger(__name__)


def text_config_of(config: Any) -> Any:
    """The config of the text model: `config` itself, or its nested ``text_config``."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except (TypeError, ValueError):
            return get()
    return config


def is_wrapped(config: Any) -> bool:
    """The text model's config is nested (a multimodal ``*ForConditionalGeneration``)."""
    return text_config_of(config) is not config


def causal_lm_class(config: Any, where: str) -> Any:
    """The transformers class a causal-LM run builds from `config` ([Note: wrapped models train
    their language model]); ConfigError naming the class where tiered cannot train it."""
    import transformers
    from transformers import AutoModelForCausalLM

    archs = getattr(config, "architectures", None) or []
    from transformers.models.auto.auto_factory import _get_model_class

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) in mapping:
        return _get_model_class(config, mapping)  # as AutoModelForCausalLM.from_config picks it
    if getattr(config, "is_encoder_decoder", False):
        name = archs[0] if archs else type(config).__name__
        raise ConfigError(
            f"--model {where}: {name} is an encoder-decoder model; tiered fine-tunes decoder-only causal LMs "
            "(and the language model of a wrapped multimodal model), not this class"
        )
    names = [a for a in archs if isinstance(a, str) and a.endswith("ForConditionalGeneration")]
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None and is_wrapped(config):
        try:
            from transformers import AutoModelForImageTextToText

            cls = AutoModelForImageTextToText._model_mapping[type(config)]
        except (ImportError, KeyError):
            cls = None
    if cls is None:
        named = archs[0] if archs else f"model_type {getattr(config, 'model_type', '?')!r}"
        raise ConfigError(
            f"--model {where}: transformers has no causal LM for {named} (and it is no *ForConditionalGeneration "
            "with a nested text model); tiered cannot fine-tune this class"
        )
    if is_wrapped(config):
        _check_text_forward(cls, where)
    return cls


def _check_text_forward(cls: Any, where: str) -> None:
    """A wrapper trains on text only if its forward takes input_ids and labels alone."""
    import inspect

    params = inspect.signature(cls.forward).parameters
    required = [
        n
        for n, p in list(params.items())[1:]
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    needs = [n for n in required if n != "input_ids"]
    if needs or "labels" not in params:
        why = f"its forward requires {', '.join(needs)}" if needs else "its forward takes no labels"
        raise ConfigError(
            f"--model {where}: {cls.__name__} cannot be fine-tuned on text ({why}); tiered trains the language "
            "model of wrappers whose forward runs on input_ids and labels alone (Gemma 3, Llava, Qwen2-VL, ...)"
        )


def language_model_of(model: nn.Module) -> tuple[str, list[str]]:
    """The name of a wrapped model's language model and of the modules that train with it (the
    output head); ConfigError naming the class where there is none."""
    config = getattr(model, "config", None)
    text = text_config_of(config)
    lm = next(
        (name for name, m in model.named_modules() if name and getattr(m, "config", None) is text),
        None,
    )
    if lm is None:
        raise ConfigError(
            f"{type(model).__name__}: its text model (config.text_config) is no separate sub-model, so tiered cannot "
            "tell which part trains on text; this wrapper class is not supported"
        )
    head = getattr(model, "get_output_embeddings", lambda: None)()
    heads = [name for name, m in model.named_modules() if head is not None and m is head]
    return lm, heads


def freeze_other_towers(model: nn.Module) -> list[str]:
    """For a wrapped model, freeze every parameter outside its language model and output head
    (kept, not trained: [Note: wrapped models train their language model]); the top-level
    modules frozen. A plain causal LM is left as it is ([])."""
    if not is_wrapped(getattr(model, "config", None)):
        return []
    lm, heads = language_model_of(model)
    keep = {id(p) for n in (lm, *heads) for p in model.get_submodule(n).parameters()}
    frozen: set[str] = set()
    for name, p in model.named_parameters():
        if id(p) not in keep:
            p.requires_grad_(False)
            parts = name.split(".")
            frozen.add(".".join(parts[: 2 if parts[0] == "model" and len(parts) > 2 else 1]))
    if frozen:
        log.info(
            "%s: training its language model (%s) and head; frozen and kept: %s",
            type(model).__name__,
            lm,
            ", ".join(sorted(frozen)),
        )
    return sorted(frozen)


def loader_class_name(model: nn.Module) -> str:
    """The class that loads `model`'s export: ``AutoModelForCausalLM`` where it builds this class,
    else the class's own name (a Llava, a Qwen2-VL)."""
    from transformers import AutoModelForCausalLM

    config = getattr(model, "config", None)
    mapping = AutoModelForCausalLM._model_mapping
    try:
        if config is not None and type(config) in mapping and causal_lm_class(config, "") is type(model):
            return "AutoModelForCausalLM"
    except ConfigError:
        pass
    return type(model).__name__


def describe_towers(model: nn.Module) -> str:
    """ ", frozen: vision_tower, multi_modal_projector" for a wrapped model (its language model
    trains), "" for a plain one."""
    if not is_wrapped(getattr(model, "config", None)):
        return ""
    lm, _ = language_model_of(model)
    frozen = sorted(
        {
            n.rsplit(".", 1)[0]
            for n, p in model.named_parameters()
            if not p.requires_grad and not n.startswith(lm + ".")
        }
    )
    tops = sorted({".".join(n.split(".")[:2]) if n.startswith("model.") else n.split(".")[0] for n in frozen})
    return f"language model {lm} and head; frozen and kept: {', '.join(tops)}" if tops else ""
