"""The sizes in a model's config.json, checked before transformers or tiered builds anything.

[Note: plausible model sizes]
Every reader of a model folder (`tiered plan --model`, `tiered finetune`, `tiered bench --model`)
builds the model from its config.json, first on the meta device. A hostile or mistyped size breaks
that build in ways that name neither the file nor the key: ``num_attention_heads: 0`` divides by
zero inside transformers, ``num_hidden_layers: 1000000000`` makes transformers list a billion
layer types and then construct a billion modules until memory runs out, ``-1`` builds a model with
no layers that plans and trains as if it were real, and ``hidden_size: 2**40`` overflows torch's
size arithmetic. So the sizes are checked on the raw JSON, by the names the file uses (GPT-2's
``n_layer`` is ``num_hidden_layers``, through the config class's ``attribute_map``), before
transformers sees them:

* each size present is an integer >= 1 (a string, a float, a bool, 0 or a negative is refused);
* at most `MAX_LAYERS` layers: deeper than any model trained (DeepNet's 1,000), and each layer is
  thousands of Python objects even on the meta device;
* a lower bound of the parameter count, the embedding (``vocab_size x hidden_size``) plus one
  layer's largest matrix (``hidden_size x max(hidden_size, intermediate_size)``), at most
  `MAX_PARAMS`; a bound, not an estimate, because some families share one layer's weights among
  all layers (ALBERT) or have no attention at all;
* attention heads that divide: no more heads than hidden dimensions (unless ``head_dim`` is
  given), and a whole number of query heads per key/value head;
* ``rope_theta`` a number > 0: transformers converts the legacy key without checking its type.

Every other key's type is transformers' own check (its configs are strict dataclasses): its
error is passed on with the file, naming the field.

A refusal names the folder's config.json and the key as written. `check_weights_fit` is the last
check before building: the parameters' own bytes against all the memory the user gave.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tiered.errors import ConfigError
from tiered.units import format_bytes

MAX_LAYERS = 10_000
MAX_PARAMS = 10**15
"""More parameters than any machine tiered plans for can hold (2 PB in bf16)."""
SIZE_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
)
"""The sizes checked, by transformers' standard attribute names."""


def written_key(config_cls: Any, name: str) -> str:
    """The key a config.json of `config_cls` spells standard attribute `name` with."""
    mapping = getattr(config_cls, "attribute_map", None) or {}
    return str(mapping.get(name, name))


def _sizes(data: Mapping[str, Any], config_cls: Any, where: str) -> dict[str, tuple[str, int]]:
    """{standard name: (key as written, value)} of the sizes `data` gives, each checked to be an
    integer >= 1."""
    found: dict[str, tuple[str, int]] = {}
    for name in SIZE_KEYS:
        for key in dict.fromkeys((written_key(config_cls, name), name)):
            if key not in data or data[key] is None:
                continue
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(
                    f"{where}: {key} is {value!r} ({type(value).__name__}); a size is a whole number >= 1"
                )
            if value < 1:
                raise ConfigError(
                    f"{where}: {key} is {value}; a size is a whole number >= 1"
                    + (" (a model with no layers trains nothing)" if name == "num_hidden_layers" else "")
                )
            found.setdefault(name, (key, value))
    return found


RATE_KEYS = ("rope_theta",)
"""Numbers > 0 that transformers reads without checking their type (a legacy key it converts into
``rope_parameters``): a string there fails deep inside the first forward."""


def _rates(data: Mapping[str, Any], where: str) -> None:
    for key in RATE_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ConfigError(f"{where}: {key} is {value!r}; it is a number > 0 (e.g. 10000.0)")


def check_config_sizes(data: Mapping[str, Any], config_cls: Any, where: str) -> None:
    """[Note: plausible model sizes] for the raw config `data` of `config_cls` (None where the
    class is unknown: the standard names only), and for each nested config it holds (a
    multimodal model's ``text_config``); `where` names the file in every refusal."""
    _check_one(data, config_cls, where)
    for key, sub in data.items():
        if isinstance(sub, Mapping) and key.endswith("_config") and key != "quantization_config":
            _check_one(sub, None, f"{where} ({key})")


def _check_one(data: Mapping[str, Any], config_cls: Any, where: str) -> None:
    _rates(data, where)
    sizes = _sizes(data, config_cls, where)
    if "num_hidden_layers" in sizes and sizes["num_hidden_layers"][1] > MAX_LAYERS:
        key, layers = sizes["num_hidden_layers"]
        raise ConfigError(
            f"{where}: {key} is {layers:,}, more than {MAX_LAYERS:,} layers (deeper than any model trained; "
            "each layer is thousands of objects even on the meta device): fix the file"
        )
    hidden = sizes.get("hidden_size")
    if hidden is not None:
        vocab = sizes.get("vocab_size", ("", 0))
        inter = sizes.get("intermediate_size", ("", 0))
        floor = vocab[1] * hidden[1] + hidden[1] * max(hidden[1], inter[1])
        if floor > MAX_PARAMS:
            named = ", ".join(f"{k} {v:,}" for k, v in (hidden, vocab, inter) if k)
            raise ConfigError(
                f"{where}: {named} mean at least {floor:.3g} parameters (the embedding and one layer's "
                f"largest matrix), more than any machine holds (> {MAX_PARAMS:.0e}): fix the file"
            )
    heads = sizes.get("num_attention_heads")
    if heads is not None and hidden is not None and "head_dim" not in sizes and heads[1] > hidden[1]:
        raise ConfigError(
            f"{where}: {heads[0]} ({heads[1]}) is more than {hidden[0]} ({hidden[1]}): each head would "
            "have no dimensions; fix the file (or give head_dim)"
        )
    kv = sizes.get("num_key_value_heads")
    if heads is not None and kv is not None and (kv[1] > heads[1] or heads[1] % kv[1]):
        raise ConfigError(
            f"{where}: {heads[0]} ({heads[1]}) is not a whole multiple of {kv[0]} ({kv[1]}): each "
            "key/value head serves a whole group of query heads; fix the file"
        )


def check_weights_fit(
    params: int, bytes_per_param: int, memory_bytes: int, memories: str, where: str
) -> None:
    """ConfigError when `params` parameters of `bytes_per_param` bytes each (the weights alone)
    exceed `memory_bytes`, all the memory the user gave (`memories` names the flags): nothing
    can fit, whatever the placement, so nothing is built or searched."""
    need = params * bytes_per_param
    if need > memory_bytes:
        raise ConfigError(
            f"{where}: {params:,} parameters need {format_bytes(need)} for their weights alone "
            f"({bytes_per_param} B each), more than all the memory given ({memories}: "
            f"{format_bytes(memory_bytes)}); no placement can fit it: check the model's sizes or give more memory"
        )
