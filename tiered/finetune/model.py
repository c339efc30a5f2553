"""Build a causal LM from a local Hugging Face folder or config.json: nothing is downloaded.

[Note: local models only]
`--model` is a folder with config.json (and optionally *.safetensors weights and tokenizer
files) or a bare config.json. The model is built with AutoModelForCausalLM.from_config in fp32
(the engine keeps fp32 masters and casts to the config's compute dtype itself), then, when the
folder has safetensors files, their tensors are loaded by name. A key the model does not have, or
a parameter the files do not cover (tied weights excepted), is an error naming the file: a
half-loaded model would train, but not the model the user meant.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tiered.errors import ConfigError, WeightsError
from tiered.planning.hf_config import ModelSource, load_hf_config, resolve_model
from tiered.zero.load import check_file_dtype, match_file_keys

__all__ = ["ModelSource", "build_model", "load_hf_config", "resolve_model"]

log = logging.getLogger(__name__)


def _load_weights(model: torch.nn.Module, files: tuple[Path, ...]) -> None:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    found_in: dict[str, Path] = {}
    for f in files:  # the streamed load's files ([Note: streaming load]: resolve_model chose them)
        try:
            tensors = load_file(str(f))
        except Exception as exc:  # noqa: BLE001 - a corrupt file is the user's to fix
            raise ConfigError(f"--model {f}: cannot read safetensors weights: {exc}") from None
        for k, t in tensors.items():
            if k in found_in:  # never one file silently overriding another
                raise ConfigError(
                    f"--model {f.parent}: tensor {k} is in both {found_in[k].name} and {f.name}; remove "
                    "the stale file (or add model.safetensors.index.json naming the right one)"
                )
            found_in[k] = f
            state[k] = t
    names = {f.name for f in files}
    own: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers()))
    try:  # the streamed load's matching: the base model's prefix, the keys transformers ignores
        name_of = match_file_keys(model, list(state), ", ".join(sorted(names)))
    except WeightsError as exc:
        raise ConfigError(f"--model {exc}") from None
    state = {name_of[k]: t for k, t in state.items() if k in name_of}
    for k, t in state.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise ConfigError(
                f"--model {', '.join(sorted(names))}: tensor {k} has shape {tuple(t.shape)}, the model "
                f"expects {tuple(own[k].shape)}; do the weights belong to this config.json?"
            )
        if own[k].is_floating_point() and not t.is_floating_point():
            file_key = next(f for f, n in name_of.items() if n == k)
            check_file_dtype(file_key, str(t.dtype).removeprefix("torch."), found_in[file_key], k, own[k])
    loaded_ptrs = {own[k].data_ptr() for k in state}
    missing = sorted(
        n
        for n, prm in model.named_parameters(remove_duplicate=False)
        if n not in state and prm.data_ptr() not in loaded_ptrs
    )
    if missing:
        raise ConfigError(
            f"--model {', '.join(sorted(names))}: no weights for {len(missing)} parameters, e.g. "
            f"{missing[:3]}; the files do not cover this model"
        )
    with torch.no_grad():
        for k, t in state.items():
            own[k].copy_(t.to(own[k].dtype))
    log.info("loaded %d tensors from %s", len(state), ", ".join(sorted(names)))


def _check_host_fits(model: torch.nn.Module, source: ModelSource) -> None:
    """The model is about to be built in host memory in fp32: its weights alone must fit this
    machine's memory ([Note: plausible model sizes]), else the build is refused, not run until
    the allocator or the kernel's OOM killer stops it."""
    from tiered.device import Device
    from tiered.planning.model_sizes import check_weights_fit

    total = Device("cpu").mem_info()[1]
    if total is None:
        return
    check_weights_fit(
        sum(p.numel() for p in model.parameters()),
        4,
        total,
        "this machine's memory: the model is built there in fp32 when the folder has no safetensors "
        "weights, or with --lora or --compare-torch",
        f"--model {source.config_path}",
    )


def build_model(
    source: ModelSource, *, seed: int = 0, attn_implementation: str = "eager", meta: bool = False
) -> torch.nn.Module:
    """An fp32 AutoModelForCausalLM from `source` ([Note: local models only]); weights are
    initialised from torch.manual_seed(seed) unless the folder has safetensors files. With
    `meta`, on the meta device and without weights: the engine streams them from the folder
    (``initialize(..., weights=source.folder)``, [Note: streaming load]).

    Eager attention by default: the same math on every machine, so a run can be compared with
    plain PyTorch to the last digits."""
    from transformers import AutoModelForCausalLM

    config = load_hf_config(source)

    def build(on: str) -> torch.nn.Module:
        try:
            with torch.device(on):
                built: torch.nn.Module = AutoModelForCausalLM.from_config(
                    config, attn_implementation=attn_implementation, dtype=torch.float32
                )
        except Exception as exc:  # noqa: BLE001 - a config transformers cannot build is the user's to fix
            raise ConfigError(
                f"--model {source.config_path}: transformers cannot build a causal LM from it: {exc}"
            ) from None
        return built

    if not meta:  # counted on the meta device first: fp32 weights larger than the host are refused
        _check_host_fits(build("meta"), source)
    torch.manual_seed(seed)
    model = build("meta" if meta else "cpu")
    model = model.float()
    from tiered.engine.pretrained import read_generation_config

    read_generation_config(model, source.folder)  # exported with the model ([Note: streamed export])
    if source.weight_files and not meta:
        _load_weights(model, source.weight_files)
    return model.train()
