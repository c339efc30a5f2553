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
from typing import Any

import torch

from tiered.errors import ConfigError, WeightsError
from tiered.planning.hf_config import ModelSource, load_hf_config, resolve_model

__all__ = ["ModelSource", "build_model", "load_hf_config", "resolve_model"]

log = logging.getLogger(__name__)


def _load_weights(model: torch.nn.Module, files: tuple[Path, ...]) -> None:
    """The folder's tensors into `model`, matched and assembled as the streamed load does
    ([Note: file tensors by transformers' conversions]): the same files, names, merges and checks."""
    from tiered.zero.load import WeightSource

    try:  # resolve_model chose `files` by the rule WeightSource follows (weight_files)
        source = WeightSource(files[0].parent)
        plan = source.plan(model, init_missing=False)
    except WeightsError as exc:
        raise ConfigError(f"--model {exc}") from None
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            p.copy_(plan.read_whole(p).to(p.dtype))
    plan.load_buffers(model)
    log.info("loaded %d tensors from %s", len(source.file_of), ", ".join(sorted({f.name for f in files})))


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
    from tiered.planning.text_model import causal_lm_class, freeze_other_towers

    config = load_hf_config(source)

    cls: Any = causal_lm_class(
        config, str(source.config_path)
    )  # [Note: wrapped models train their language model]

    def build(on: str) -> torch.nn.Module:
        try:
            with torch.device(on):
                built: torch.nn.Module = cls._from_config(
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
    freeze_other_towers(model)
    from tiered.engine.pretrained import read_generation_config

    read_generation_config(model, source.folder)  # exported with the model ([Note: streamed export])
    if source.weight_files and not meta:
        _load_weights(model, source.weight_files)
    return model.train()
