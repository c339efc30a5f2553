"""`save_pretrained`: the model's weights consolidated into a Hugging Face directory, streamed.

[Note: streamed export]
The export writes the layout ``from_pretrained`` reads: config.json (and generation_config.json)
when the model has a Hugging Face config, ``model.safetensors`` or, beyond `max_shard_size`,
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``. Every name,
shape and dtype is known from the shard groups before a byte is read, so each shard's header is
written first (see [Note: streamed safetensors]) and the groups are then gathered one at a time
(every rank takes part in the gather; rank 0 writes), each parameter cast to `dtype` and
appended: memory grows by one group, never the model. Each file is written under a temporary
name and renamed into place, so an interrupted export never leaves a partial file where a good
one was; shards of an earlier export that the new one does not name are removed, as
transformers does, so a loader cannot mix two exports.

[Note: tokenizer files in the export]
A folder `from_pretrained` loads is only useful with its tokenizer, so the export writes one
when it knows it: ``save_pretrained(dir, tokenizer=tok)`` calls the tokenizer object's own
``save_pretrained``; ``tokenizer=FOLDER`` (and, by default, the folder the engine's weights were
streamed from: ``tiered.from_pretrained`` / ``initialize(..., weights=FOLDER)``) copies that
folder's tokenizer files byte for byte (`TOKENIZER_FILES` and the ``additional_chat_templates/``
folder): what ``AutoTokenizer.from_pretrained`` reads for the fast and the sentencepiece / BPE /
WordPiece slow tokenizers, their special and added tokens and the chat templates. Copying, not
loading and re-saving, keeps the files exactly as shipped and needs neither `tokenizers` nor a
tokenizer class that can be built. Not copied: config.json and generation_config.json (model
files, written from the model; the generation config is read from the folder when the model is
built, as transformers does), weights, and custom ``tokenization_*.py`` code (remote code is the
user's to trust and copy). ``tokenizer=False`` writes no tokenizer.

[Note: exporting a peft model]
A peft model's own names (``base_model.model.<name>``, ``<layer>.base_layer.weight``) are not a
transformers checkpoint: written as one, ``AutoModelForCausalLM.from_pretrained`` would find
none of its keys and start from random weights with only a load report. So the export of a
peft model is the adapter in peft's format (adapter_config.json, adapter_model.safetensors:
what ``PeftModel.from_pretrained(base, dir)`` loads): only the trainable parameters are
gathered, peft names and filters them (``get_peft_model_state_dict``). The merged model needs
every base weight next to its adapter, so it is written after ``engine.close()`` gave the
module its trained weights back: ``model.merge_and_unload().save_pretrained(dir)`` (what
``tiered finetune --merge-lora`` does).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tiered.checkpoint import directory as d
from tiered.checkpoint.stream import StreamWriter, TensorSpec
from tiered.errors import ConfigError
from tiered.units import parse_bytes

log = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
INDEX = "model.safetensors.index.json"
# The files of a Hugging Face tokenizer a model folder may ship ([Note: tokenizer files in the export]).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a `tokenizer=` argument the export cannot write, before any file is written."""
    if tokenizer is None or tokenizer is False:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        if not Path(tokenizer).is_dir():
            raise ConfigError(
                f"save_pretrained(tokenizer={os.fspath(tokenizer)!r}): no such folder; pass the model folder "
                "holding the tokenizer files, a tokenizer object, or tokenizer=False"
            )
        return
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            f"save_pretrained(tokenizer=...): a {type(tokenizer).__name__} has no save_pretrained(dir); pass a "
            "Hugging Face tokenizer, the folder holding its files, or tokenizer=False"
        )


def write_tokenizer(out_dir: str, tokenizer: Any) -> list[str]:
    """Write `tokenizer` (a tokenizer object, a folder whose tokenizer files are copied, or
    None / False: nothing) into `out_dir`; the names written. See [Note: tokenizer files in the
    export]."""
    check_tokenizer(tokenizer)
    if tokenizer is None or tokenizer is False:
        return []
    if not isinstance(tokenizer, (str, os.PathLike)):
        return [os.path.basename(f) for f in tokenizer.save_pretrained(out_dir) or ()]
    src = Path(tokenizer)
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    templates = src / CHAT_TEMPLATE_DIR
    if templates.is_dir():
        names += [f"{CHAT_TEMPLATE_DIR}/{f.name}" for f in sorted(templates.iterdir()) if f.is_file()]
        os.makedirs(os.path.join(out_dir, CHAT_TEMPLATE_DIR), exist_ok=True)
    for name in names:
        dest = os.path.join(out_dir, name)
        if os.path.exists(dest) and os.path.samefile(src / name, dest):
            continue  # exporting into the folder the tokenizer came from
        tmp = os.path.join(os.path.dirname(dest), f".{os.path.basename(name)}.partial")
        shutil.copyfile(src / name, tmp)
        d.fsync_file(tmp)
        os.replace(tmp, dest)  # never a partial file where a good one was
    if not names:
        log.info("%s holds no tokenizer files: the export has none", src)
    return names


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for mname, m in model.named_modules():
        for bname, buf in m._buffers.items():
            if buf is not None and bname not in m._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, buf))
    return out


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive specs into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )


FileLayout = Mapping[str, Sequence[tuple[str, tuple[int, ...], Sequence[tuple[int, int, int]]]]]
"""model name -> the file tensors transformers' ``save_pretrained`` writes for it: (file key, shape,
runs of (param_start, file_start, length) that cut it from the flat tensor); see [Note: file
tensors by transformers' conversions] in tiered/zero/conversions.py."""


def _file_tensors(
    layout: FileLayout | None, name: str, t: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """`t` (the model's `name`) as the file tensor(s) it is written as."""
    parts = layout.get(name) if layout else None
    if not parts:
        yield name, t
        return
    flat = t.reshape(-1)
    for key, shape, runs in parts:
        if len(runs) == 1 and runs[0][1] == 0:  # one expert's slice: a view, copied once by the cast
            ps, _, n = runs[0]
            yield key, flat[ps : ps + n].view(shape)
            continue
        out = torch.empty(math.prod(shape), dtype=t.dtype, device=t.device)
        for ps, fs, n in runs:
            out[fs : fs + n].copy_(flat[ps : ps + n])
        yield key, out.view(shape)


def save_pretrained(
    model: torch.nn.Module,
    full_groups: Iterator[tuple[Any, list[tuple[str, torch.Tensor]]]],
    groups: list[Any],
    save_directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    max_shard_size: int | str,
    writer: bool,
    tokenizer: Any = None,
    file_layout: FileLayout | None = None,
) -> str:
    """Write the Hugging Face layout of [Note: streamed export], with `tokenizer` ([Note:
    tokenizer files in the export]). `full_groups` gathers the groups one by one (every rank
    iterates it); only the `writer` rank touches the disk. `file_layout`: the names and pieces
    transformers writes for the tensors it converts on load (per-expert files of a fused MoE
    parameter, a wrapped model's legacy names); the rest keep the model's names."""
    out_dir = os.fspath(save_directory)
    max_bytes = parse_bytes(max_shard_size, what="save_pretrained(max_shard_size=...)")
    check_tokenizer(tokenizer)
    buffers = persistent_buffers(model)

    def spec_list(name: str, shape: tuple[int, ...], dt: torch.dtype) -> list[TensorSpec]:
        parts = file_layout.get(name) if file_layout else None
        return [TensorSpec(k, dt, tuple(s)) for k, s, _ in parts] if parts else [TensorSpec(name, dt, shape)]

    # (a parameter in pieces is written whole, with its first piece: [Note: fused parameters in pieces])
    specs = [s for g in groups for e in g.entries if e.start == 0 for s in spec_list(e.name, e.shape, dtype)]
    for n, b in buffers:
        specs += spec_list(n, tuple(b.shape), dtype if b.is_floating_point() else b.dtype)
    shards = plan_shards(specs, max_bytes)
    names = shard_names(len(shards))
    shard_of = {s.name: i for i, shard in enumerate(shards) for s in shard}
    file_of = {name: names[i] for name, i in shard_of.items()}
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        d.check_free_space(out_dir, sum(s.nbytes for s in specs))
        _write_config(model, out_dir, dtype)
        write_tokenizer(out_dir, tokenizer)
    current: list[Any] = [None, -1]  # open StreamWriter, shard index

    def put(name: str, t: torch.Tensor) -> None:
        if not writer:
            return
        i = shard_of[name]
        if current[1] != i:
            _finish(current[0], out_dir)
            current[0] = StreamWriter(
                os.path.join(out_dir, f".{names[i]}.partial"), shards[i], {"format": "pt"}
            )
            current[1] = i
        current[0].append(t.detach().to(dtype if t.is_floating_point() else t.dtype).to("cpu").contiguous())

    try:
        for _g, params in full_groups:
            for name, t in params:
                for key, part in _file_tensors(file_layout, name, t):
                    put(key, part)
        for name, b in buffers:
            for key, part in _file_tensors(file_layout, name, b):
                put(key, part)
        _finish(current[0], out_dir)
        current[0] = None
    except BaseException:
        if current[0] is not None:
            current[0].close()
            os.remove(current[0].path)
        raise
    if writer:
        if len(names) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": file_of}
            tmp = os.path.join(out_dir, f".{INDEX}.partial")
            d.write_json_durably(tmp, index, mode=0o666)  # ordinary (umask): [Note: private checkpoints]
            os.replace(tmp, os.path.join(out_dir, INDEX))
        elif os.path.exists(os.path.join(out_dir, INDEX)):
            os.remove(os.path.join(out_dir, INDEX))
        for f in os.listdir(out_dir):  # shards of an earlier export: see [Note: streamed export]
            if _SHARD_RE.match(f) and f not in names:
                os.remove(os.path.join(out_dir, f))
        d.fsync_dir(out_dir)
        log.info("exported %d parameters in %d shard(s) to %s", len(specs), len(names), out_dir)
    return out_dir


def _finish(w: StreamWriter | None, out_dir: str) -> None:
    if w is None:
        return
    w.finish()
    final = os.path.join(out_dir, os.path.basename(w.path)[1 : -len(".partial")])
    os.replace(w.path, final)


def _write_config(model: torch.nn.Module, out_dir: str, dtype: torch.dtype) -> None:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        # The dtype the weights are written in, not the model's: from_pretrained loads by it (a copy:
        # the model's own config is not ours to change).
        cfg = copy.deepcopy(cfg)
        cfg.dtype = dtype
        cfg.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            gen.save_pretrained(out_dir)
        except (ValueError, TypeError) as e:  # an invalid generation config must not lose the weights
            log.warning("generation_config.json not written: %s", e)
    elif cfg is None:
        log.info("the model has no Hugging Face config: %s holds the weights only", out_dir)


def is_peft_model(model: torch.nn.Module) -> bool:
    """A peft PeftModel (duck-typed: peft is an optional dependency)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def write_peft_adapter(
    model: torch.nn.Module, values: dict[str, torch.Tensor], directory: str, *, base_model: Any = None
) -> str:
    """Write the adapter `values` (the model's trainable parameters by name) of peft `model`
    in peft's format ([Note: exporting a peft model]); the writing rank only."""
    import copy

    import peft
    from safetensors.torch import save_file

    state = peft.get_peft_model_state_dict(model, state_dict=values)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, ".adapter_model.safetensors.partial")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, "adapter_model.safetensors"))
    cfg: Any = copy.deepcopy(getattr(model, "peft_config")["default"])  # noqa: B009 - a PeftModel attribute
    cfg.inference_mode = True
    if base_model is not None:
        cfg.base_model_name_or_path = str(base_model)
    cfg.save_pretrained(directory)
    log.info("exported the peft adapter (%d tensors) to %s", len(state), directory)
    return directory


def save_peft_adapter(
    model: torch.nn.Module,
    gathered: Any,
    save_directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    writer: bool,
    base_model: Any,
    tokenizer: Any,
) -> str:
    """A peft model's export ([Note: exporting a peft model]): its trainable parameters gathered
    (`gathered(params)`: the engine's gathered_parameters, entered by every rank), cast to
    `dtype`, written by the `writer` rank with `tokenizer`. The adapter config's base model is
    kept, or else `base_model` (the folder the weights came from)."""
    check_tokenizer(tokenizer)
    names = {id(p): n for n, p in model.named_parameters()}
    adapter = [p for p in model.parameters() if p.requires_grad]
    with gathered(adapter):
        values = {
            names[id(p)]: p.detach().to("cpu", dtype if p.is_floating_point() else p.dtype, copy=True)
            for p in adapter
        }
    out = os.fspath(save_directory)
    if writer:
        cfg = getattr(model, "peft_config")["default"]  # noqa: B009 - a PeftModel attribute
        write_peft_adapter(model, values, out, base_model=cfg.base_model_name_or_path or base_model)
        write_tokenizer(out, tokenizer)
    return out
