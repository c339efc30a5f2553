"""The one reader of a local Hugging Face model's config.json: `tiered finetune`, `tiered bench
--model` and `tiered plan --model` all build their model from what it returns, so a folder
means the same model to each (no download: [Note: local models only] in tiered/finetune/model.py).
"""

from __future__ import annotations

import logging
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered.config.user_files import kind_of, read_user_json, unreadable
from tiered.errors import ConfigError, TieredError
from tiered.planning.model_sizes import check_config_sizes

log = logging.getLogger(__name__)
_said_own_code: set[Path] = set()  # each folder's auto_map warning once per process
CONFIG_MAX_BYTES = 16 << 20
"""The largest config.json read (a few kilobytes is usual; a label map may reach a megabyte)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: its config file, its folder (None for a bare config.json) and
    the safetensors files found there."""

    config_path: Path
    folder: Path | None
    weight_files: tuple[Path, ...]
    flag: str = "--model"
    """How the user named it, in every error: the flag, or the Python call."""


def _weights_or_none(folder: Path) -> tuple[Path, ...]:
    """The folder's safetensors; none only where it holds no weights at all (the model is then
    initialised): an index without its shards, or weights in a format tiered does not read, are
    refused rather than trained from random weights."""
    from tiered.errors import WeightsError
    from tiered.zero.load import (
        INDEX_NAME,
        convert_hint,
        quantization_method,
        quantized_message,
        unread_weight_files,
        weight_files,
    )

    try:  # the files the streamed load reads, by the same rules ([Note: streaming load])
        found = tuple(weight_files(folder)[0])
    except WeightsError as exc:
        raise ConfigError(f"--model {folder}: {exc}") from None
    quant = quantization_method(folder)
    if found and quant is not None:
        raise ConfigError(f"--model {folder}: {quantized_message(quant)}")
    if found:
        return found
    if (folder / INDEX_NAME).is_file():
        raise ConfigError(
            f"--model {folder}: {INDEX_NAME} is there but none of its *.safetensors shards: the download "
            "is incomplete; fetch the shards (or remove the index to train from random weights)"
        )
    other = unread_weight_files(folder)
    if other:
        raise ConfigError(
            f"--model {folder}: its weights are {', '.join(other)}, which tiered does not read (safetensors "
            f"only: no pickle is ever loaded), and training would start from random weights instead; "
            f"{convert_hint(folder)}"
        )
    return ()


def resolve_model(path: str | Path, *, weights: bool = True, flag: str = "--model") -> ModelSource:
    """The config and weights of `path`; with ``weights=False`` (a plan: shapes only) the
    weights are not looked at. What is not a folder or a regular file is named
    ([Note: files a user names]); `flag` is how the user named `path`."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(
            f"{flag} {path}: no such file or folder; pass a local Hugging Face model folder "
            "(with config.json) or a config.json file"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: {exc.strerror or exc}; pass a readable model folder") from None
    if stat.S_ISDIR(st.st_mode):
        cfg = p / "config.json"
        try:
            mode = cfg.stat().st_mode
        except FileNotFoundError:
            raise ConfigError(
                f"{flag} {path}: folder has no config.json; pass a Hugging Face model folder"
            ) from None
        except PermissionError:
            raise ConfigError(unreadable(cfg, flag)) from None
        if not stat.S_ISREG(mode):
            raise ConfigError(
                f"{flag} {path}: its config.json is {kind_of(mode)}, not a regular file; put the "
                "model's config.json there"
            )
        return ModelSource(cfg, p, _weights_or_none(p) if weights else (), flag)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"{flag} {path}: is {kind_of(st.st_mode)}; pass a local Hugging Face model folder or a config.json file"
        )
    return ModelSource(p, None, (), flag)


def load_hf_config(source: ModelSource) -> Any:
    """The transformers config (PretrainedConfig) of `source`: config.json read as [Note: files
    a user names] says, its sizes checked ([Note: plausible model sizes]) before transformers
    sees them, and transformers' own validation errors named with the file and key."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise TieredError(
            "reading a Hugging Face model folder needs transformers; install it with "
            "pip install 'tiered[hf]' (tiered plan: or pass --params instead)"
        ) from exc
    where = f"{source.flag} {source.config_path}"
    data = read_user_json(
        source.config_path,
        source.flag,
        CONFIG_MAX_BYTES,
        hint="pass the model's config.json",
        not_json="not a readable JSON config",
    )
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f'{where}: config has no "model_type" key; is it a Hugging Face config.json?')
    model_type = data.pop("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f'{where}: model_type is {model_type!r}; it names a model family, e.g. "llama"')
    auto_map = data.get("auto_map")
    if isinstance(auto_map, dict) and auto_map and source.config_path not in _said_own_code:
        _said_own_code.add(source.config_path)
        log.warning(
            "%s %s: config.json's auto_map names the folder's own code (%s); tiered never runs a "
            "model folder's code ([Note: local models only]): it builds transformers' own class for "
            "model_type %r, which must have the same parameters (a weight it lacks is an error at load)",
            source.flag,
            source.config_path,
            ", ".join(sorted(str(v) for v in auto_map.values())),
            model_type,
        )
    check_config_sizes(data, _config_class(model_type), where)
    try:
        config = AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # noqa: BLE001 - transformers' validation of the user's file, named
        import transformers

        why = " ".join(str(exc).split())
        if "Unrecognized model identifier" in why:  # its next sentence lists every model type known
            raise ConfigError(
                f"{where}: unknown or invalid model_type {model_type!r}: transformers "
                f"{transformers.__version__} does not know it (a newer transformers, or a model whose code "
                "ships with it, which tiered does not run)"
            ) from None
        raise ConfigError(
            f"{where}: transformers {transformers.__version__} refuses this {model_type} config: {why}; fix "
            "that key in config.json"
        ) from None
    return config


def _config_class(model_type: str) -> Any:
    """transformers' config class for `model_type`, without building one (None if unknown)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except (KeyError, ValueError):
        return None


def build_meta_model(source: ModelSource) -> Any:
    """`source`'s model on the meta device (shapes, no storage): a causal LM (a wrapped multimodal
    model with its other towers frozen: [Note: wrapped models train their language model]), or
    the base model where the config is none (an encoder). ConfigError when transformers cannot
    build it, or for a wrapper tiered cannot train (naming the class)."""
    import torch
    from transformers import AutoModel

    from tiered.planning.text_model import causal_lm_class, freeze_other_towers, is_wrapped

    config = load_hf_config(source)
    try:
        cls: Any = causal_lm_class(config, str(source.config_path))
    except ConfigError:
        if is_wrapped(config):
            raise
        cls = None  # not a causal LM: the base model's parameters are what trains
    try:
        with torch.device("meta"):
            model = cls._from_config(config) if cls is not None else AutoModel.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build is the user's to fix
        raise ConfigError(
            f"{source.flag} {source.config_path}: transformers could not build the model from its config: {exc}"
        ) from None
    freeze_other_towers(model)
    return model
