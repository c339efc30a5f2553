"""Which file tensors make each parameter, by transformers' own load-time conversions of the family.

[Note: file tensors by transformers' conversions]
transformers 5 does not load every family's files name for name: it renames keys (GPT-NeoX's
``embed_out`` is ``lm_head``; Gemma 3's ``language_model.model.*`` is ``model.language_model.*``;
Mixtral's ``block_sparse_moe`` is ``mlp``) and it *merges* per-expert tensors into the fused
3-D parameters its MoE classes hold: Mixtral's ``experts.{e}.w1`` / ``w3`` are stacked per expert
and concatenated into ``experts.gate_up_proj`` [E, 2I, H], ``experts.{e}.w2`` stacked into
``experts.down_proj`` [E, H, I]; Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE and their kin do the same with
``gate_proj`` / ``up_proj`` / ``down_proj``. The rules are transformers' own
(``conversion_mapping.get_model_conversion_mapping``: the family's renames and ``WeightConverter``s
with their operations, scoped to nested sub-models), and this module reads them instead of
keeping a table of its own: each file key is renamed with ``rename_source_key`` exactly as
``from_pretrained`` renames it, and a converter's operations are applied *symbolically*, to
shapes and not to values, in transformers' order (``MergeModulelist`` stacks each source
pattern's tensors, ``Concatenate`` joins the patterns in their declared order).

What comes out is, per parameter, a list of `Run`s: elements [param_start, param_start + length)
of the flat parameter are elements [file_start, ...) of one file tensor. For the MoE merges each
expert's file tensor is one run (a box of the fused tensor that spans its trailing dimensions is
contiguous). The streamed load (tiered/zero/load.py) reads just the runs that fall into a rank's
shard, in bounded chunks, straight into the shard: no fused tensor is ever assembled on the host.
The export (tiered/checkpoint/export.py) uses the same runs the other way: transformers' reverse
conversion (``revert_weight_conversion``, run on meta tensors) names the files it would write, and
each file tensor is cut from the gathered parameter by its runs, so the folder has the names and
layout ``save_pretrained`` writes.

Operations other than ``MergeModulelist`` and ``Concatenate`` (``Chunk``, ``Transpose``,
``Interleave``, dequantizers, ...) move elements in ways a run list does not describe cheaply; a
family whose files need one is refused naming the operation and the tensors, never loaded wrong.

Checks, each an error naming tensors and files: the experts of one fused parameter must be
exactly 0..E-1 (a missing one is named, with the shard the index puts it in); stacked experts
must have equal shapes; the assembled shape must be the parameter's; a parameter may not be
given twice (a file holding both ``experts.0.gate_proj.weight`` and the fused
``experts.gate_up_proj``: both are named); a quantized tensor (int8, uint8, float8, packed int32)
for a floating parameter, or quantization scales, is refused as a quantized checkpoint.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiered.errors import WeightsError
from tiered.zero.file_runs import Cat, Leaf, Node, Stack, TensorSource, no_file, runs_of, single

log = logging.getLogger(__name__)

_QUANT_SUFFIXES = (
    "weight_scale_inv",
    "weight_scale",
    "input_scale",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "absmax",
    "quant_map",
    "quant_state",
    "weight_packed",
    "weight_zero_point",
    "SCB",
)
_SAFETENSORS_CODES = {
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
"""safetensors' names of the integer dtypes, as a file's header spells them."""
_QUANT_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int16} | {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
}


# ---- transformers' conversions ------------------------------------------------------------------
def model_conversions(model: nn.Module) -> list[Any]:
    """transformers' load-time conversions of `model` (renames and converters, the sub-models'
    scoped), as ``from_pretrained`` gets them; [] where it has none (or no transformers, or
    `model` is not a transformers model)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    try:
        return list(get_model_conversion_mapping(model) or [])
    except Exception as exc:  # noqa: BLE001 - a mapping transformers cannot build: load names as they are
        log.warning(
            "transformers' weight conversions of %s are not available (%s)", type(model).__name__, exc
        )
        return []


def dot_natural_key(key: str) -> Any:
    """transformers' order of state-dict names (numbers numerically), in which it collects the
    tensors a converter stacks."""
    try:
        from transformers.core_model_loading import dot_natural_key as natural
    except ImportError:
        return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]
    return natural(key)


def _is_converter(c: Any) -> bool:
    return hasattr(c, "operations")


def _op_text(ops: Sequence[Any]) -> str:
    return ", ".join(repr(op) for op in ops)


# ---- matching a folder's keys with a model ---------------------------------------------------------
@dataclass
class FileMatch:
    """The outcome of matching file tensors with a model (see [Note: file tensors by transformers'
    conversions])."""

    sources: dict[str, TensorSource]
    """model name -> where it comes from."""
    ignored: list[str]
    """File keys the class tells transformers to ignore on load (left out, one log line)."""


def match_files(
    model: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    listed_in: Callable[[str], str] = no_file,
    at: Callable[[str], str] = no_file,
    path_of: Callable[[str], str] | None = None,
    model_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> FileMatch:
    """Each model tensor's `TensorSource` among the file tensors `shapes` (key -> shape), as
    ``from_pretrained`` would load them ([Note: file tensors by transformers' conversions]).
    `where` names the folder in errors, `at(key)` the file of a key (" in model-0001...");
    `listed_in(key)` says where an index puts a missing key, `path_of(key)` the file's path;
    `model_shapes` overrides the model's own shapes (an engine's parameters are placeholders)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    own: dict[str, tuple[int, ...]] = {n: tuple(p.shape) for n, p in params.items()}
    float_dtypes = {n: p.dtype for n, p in params.items() if p.is_floating_point()}
    for n, b in model.named_buffers():
        own.setdefault(n, tuple(b.shape))
    own.update(model_shapes or {})
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    conversions = model_conversions(model)
    renamings = [c for c in conversions if not _is_converter(c)]
    converters = [c for c in conversions if _is_converter(c)]
    meta_state = dict.fromkeys(own, True)
    rename = _renamer(renamings, converters, prefix, meta_state)

    direct: dict[str, str] = {}  # model name -> file key
    merged: dict[str, tuple[Any, dict[str, list[str]]]] = {}  # model name -> (converter, pattern -> keys)
    unexpected: list[str] = []
    ignored: list[str] = []
    for k in sorted(shapes, key=dot_natural_key):
        name, pattern = rename(k)
        if name not in own:
            (ignored if any(r.search(k) for r in ignore) else unexpected).append(k)
            continue
        if pattern is None:
            if name in direct:  # "x" and "model.x" both in the files: which is meant is not ours to guess
                raise WeightsError(
                    f"weights in {where}: {direct[name]}{at(direct[name])} and {k}{at(k)} are both the model's {name}"
                )
            direct[name] = k
        else:
            conv = merged.setdefault(name, (_converter_for(converters, pattern), {}))
            conv[1].setdefault(pattern, []).append(k)
    if ignored:
        log.info(
            "weights: %d tensors transformers ignores on load left out, e.g. %s", len(ignored), ignored[:3]
        )
    if unexpected:
        raise WeightsError(
            f"weights in {where}: {len(unexpected)} tensors the model does not have, e.g. "
            f"{', '.join(k + at(k) for k in sorted(unexpected)[:5])}; " + _why_unexpected(unexpected, model)
        )
    sources: dict[str, TensorSource] = {}
    for name, k in direct.items():
        if name in merged:
            one = next(iter(merged[name][1].values()))[0]
            raise WeightsError(
                f"weights in {where}: the model's {name} is given twice, as {k}{at(k)} and, per expert, as {one}{at(one)} "
                f"(and the others of its kind), which transformers merges into it; keep one of the two layouts"
            )
        _check_dtype(k, name, dtypes, float_dtypes, where if path_of is None else path_of(k))
        if shapes[k] != own[name]:
            raise WeightsError(
                f"tensor {k} has shape {shapes[k]}{at(k) or ' in ' + where}, the model (config.json) expects {own[name]}; "
                "do the weights belong to this config.json?"
            )
        sources[name] = single(name, k, math.prod(own[name]))
    for name, (conv, by_pattern) in merged.items():
        for keys in by_pattern.values():
            for k in keys:
                _check_dtype(k, name, dtypes, float_dtypes, where if path_of is None else path_of(k))
        sources[name] = _assemble(name, own[name], conv, by_pattern, shapes, where, listed_in, at)
    return FileMatch(sources, ignored)


def _renamer(
    renamings: list[Any], converters: list[Any], prefix: str, meta_state: dict[str, bool]
) -> Callable[[str], tuple[str, str | None]]:
    """transformers' own key renaming (renames, then at most one converter, then the base
    model's prefix added or stripped), with its fallback to the key itself."""
    rename_source_key: Any = None
    try:
        from transformers.core_model_loading import rename_source_key
    except ImportError:  # no transformers: a plain model's names, and the base prefix as transformers adds it
        pass

    def rename(key: str) -> tuple[str, str | None]:
        if rename_source_key is None:
            renamed, pattern = key, None
            if key not in meta_state and prefix and f"{prefix}.{key}" in meta_state:
                renamed = f"{prefix}.{key}"
            return renamed, pattern
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:  # as from_pretrained: the key itself
            renamed, pattern = rename_source_key(
                key, [], [], base_model_prefix=prefix, meta_state_dict=meta_state
            )
        return renamed, pattern

    return rename


def _converter_for(converters: list[Any], pattern: str) -> Any:
    return next(c for c in converters if pattern in c.source_patterns)


def _check_dtype(
    key: str,
    name: str,
    dtypes: Mapping[str, torch.dtype] | None,
    floats: Mapping[str, torch.dtype],
    where: str,
) -> None:
    """A floating-point parameter is filled only from a floating-point file tensor: integers or
    booleans (a quantized checkpoint's packed values, a converted file's) would be trained as if
    they were weights, and float8 is a quantized checkpoint's. WeightsError naming tensor and file."""
    if dtypes is None or name not in floats:
        return
    dt = dtypes.get(key)
    if dt is None:
        return
    code = _SAFETENSORS_CODES.get(dt, str(dt).removeprefix("torch."))
    if not dt.is_floating_point:
        raise WeightsError(
            f"tensor {key} in {where} is stored as {code} ({str(dt).removeprefix('torch.')}), not floating point, "
            f"but the model's {name} is a {str(floats[name]).removeprefix('torch.')} weight: its values would be "
            "trained as if they were weights; pass the model's floating-point weights (a quantized checkpoint "
            "stores packed integers and scales: pass the original, unquantized model folder; a converted file "
            "that stores integers: dequantize it first)"
        )
    if dt in _QUANT_DTYPES:
        raise WeightsError(
            f"tensor {key} in {where} holds {dt} values for the floating-point parameter {name}: a quantized "
            "checkpoint (float8 with scales), not the weights tiered trains; pass the original (unquantized) "
            "model folder"
        )


def _why_unexpected(keys: list[str], model: nn.Module) -> str:
    quant = [k for k in keys if k.rsplit(".", 1)[-1] in _QUANT_SUFFIXES]
    if quant:
        return (
            f"{quant[0]} is a quantization scale: a quantized checkpoint, not the weights tiered trains; pass the "
            "original (unquantized) model folder"
        )
    return "do the weights belong to this config.json?"


def _assemble(
    name: str,
    shape: tuple[int, ...],
    conv: Any,
    by_pattern: dict[str, list[str]],
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    listed_in: Callable[[str], str],
    at: Callable[[str], str],
) -> TensorSource:
    """`name`'s runs: `conv`'s operations applied to its file tensors' shapes, as transformers
    applies them to their values ([Note: file tensors by transformers' conversions])."""
    what = f"the model's {name} (from {where})"
    ops = list(conv.operations)
    state: dict[str, Any] = {}
    for pattern in conv.source_patterns:  # transformers' collection order: one list per source pattern
        keys = by_pattern.get(pattern)
        if keys:
            state[pattern] = [Leaf(k, tuple(shapes[k])) for k in keys]
    if len(state) < len(conv.source_patterns):
        lacking = [p for p in conv.source_patterns if p not in state]
        have = next(iter(by_pattern.values()))[0]
        raise WeightsError(
            f"{what}: transformers builds it from tensors matching {conv.source_patterns}, but the files hold "
            f"none matching {lacking} (only e.g. {have}); the folder is incomplete"
        )
    targets = list(conv.target_patterns)
    for i, op in enumerate(ops):
        kind = type(op).__name__
        dim = int(getattr(op, "dim", 0))
        if kind == "MergeModulelist":
            size = len(state)
            out: dict[str, Any] = {}
            for pattern, parts in state.items():
                if isinstance(parts, Node):
                    out[pattern if size > 1 else targets[0]] = parts
                    continue
                if i == 0:
                    parts = _in_expert_order(parts, pattern, shape, dim, what, listed_in)
                out[pattern if size > 1 else targets[0]] = Stack(dim, parts, what, at)
            state = out
        elif kind == "Concatenate" and len(targets) == 1:
            parts = []
            for pattern in conv.source_patterns:
                got = state.get(pattern)
                if got is not None:
                    parts.extend(got if isinstance(got, list) else [got])
            state = {targets[0]: Cat(dim, parts, what, at)}
        else:
            raise WeightsError(
                f"{what}: transformers assembles it from {sorted(by_pattern)} with {_op_text(ops)}; tiered's streamed "
                f"load follows MergeModulelist and Concatenate only, not {kind}: loading this family's weights is "
                "not supported (a model built from config.json alone trains)"
            )
    if len(state) != 1:
        raise WeightsError(f"{what}: transformers' conversion {_op_text(ops)} does not end in one tensor")
    node = next(iter(state.values()))
    if isinstance(node, list):
        if len(node) != 1:
            raise WeightsError(f"{what}: {len(node)} file tensors but no operation joining them")
        node = node[0]
    if node.shape != shape:
        first = next(node.boxes())[0]
        raise WeightsError(
            f"{what}: its file tensors ({first}, ...) assemble, as transformers merges them ({_op_text(ops)}), to "
            f"shape {node.shape}, the model (config.json) expects {shape}; do the weights belong to this config.json?"
        )
    runs = runs_of(node, what)
    return TensorSource(name, tuple(dict.fromkeys(r.key for r in runs)), runs, _op_text(ops))


def _in_expert_order(
    leaves: list[Node],
    pattern: str,
    shape: tuple[int, ...],
    dim: int,
    what: str,
    listed_in: Callable[[str], str],
) -> list[Node]:
    """The per-expert tensors of `pattern` by expert index, which must be exactly 0..E-1."""
    rx = re.compile(pattern.replace("*.", r"(\d+)\."))
    by_index: dict[int, Node] = {}
    for leaf in leaves:
        assert isinstance(leaf, Leaf)
        m = rx.search(leaf.key)
        if m is None or not m.groups():
            return leaves  # no numbered wildcard: transformers' (natural) order
        e = int(m.group(1))
        if e in by_index:
            raise WeightsError(f"{what}: two file tensors for expert {e} of {pattern}")
        by_index[e] = leaf
    n = shape[dim % len(shape)] if shape else 0
    missing = [e for e in range(n) if e not in by_index]
    extra = sorted(e for e in by_index if e >= n)
    if missing or extra:
        some = next(iter(by_index.values()))
        assert isinstance(some, Leaf)
        m = rx.search(some.key)
        assert m is not None
        if missing:
            lack = some.key[: m.start(1)] + str(missing[0]) + some.key[m.end(1) :]
            raise WeightsError(
                f"{what}: the files lack expert(s) {missing[:8]} of its {n}: no file holds {lack}"
                f"{listed_in(lack)}; the folder is incomplete"
            )
        raise WeightsError(
            f"{what}: the files hold expert(s) {extra[:8]} beyond its {n} experts (config.json); do the weights "
            "belong to this config.json?"
        )
    return [by_index[e] for e in range(n)]


# ---- the export's names: what save_pretrained writes --------------------------------------------------
FileLayout = dict[str, list[tuple[str, tuple[int, ...], list[tuple[int, int, int]]]]]
"""model name -> the file tensors written for it: (file key, shape, runs as (param_start,
file_start, length)), in file order; what tiered/checkpoint/export.py writes."""


def export_layout(model: nn.Module, tensors: Sequence[tuple[str, tuple[int, ...]]]) -> FileLayout | None:
    """For each of `tensors` (model name, shape) the file tensors ``save_pretrained`` writes for
    it, cut from it by their runs; None where transformers writes the model's own names. See
    [Note: file tensors by transformers' conversions]."""
    if not model_conversions(model):
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    meta = {n: torch.empty(s, device="meta") for n, s in tensors}
    try:
        saved = revert_weight_conversion(model, dict(meta))  # type: ignore[arg-type]  # a PreTrainedModel
    except Exception as exc:  # noqa: BLE001 - the model's own names then, which transformers also loads
        log.warning(
            "transformers' save-time conversion of %s failed (%s): exporting the model's names",
            type(model).__name__,
            exc,
        )
        return None
    if set(saved) == set(meta):
        return None
    file_shapes = {k: tuple(v.shape) for k, v in saved.items()}
    try:
        found = match_files(model, file_shapes, "the export", model_shapes=dict(tensors))
    except WeightsError as exc:
        log.warning("the files transformers would write for %s do not load back here (%s): exporting the "
                    "model's names", type(model).__name__, exc)  # fmt: skip
        return None
    out: FileLayout = {}
    for name, _shape in tensors:
        src = found.sources.get(name)
        if src is None:
            log.warning(
                "transformers' save-time names of %s leave out %s: exporting the model's names",
                type(model).__name__,
                name,
            )
            return None
        out[name] = [
            (
                key,
                file_shapes[key],
                [(r.param_start, r.file_start, r.length) for r in src.runs if r.key == key],
            )
            for key in src.keys
        ]
    return out
