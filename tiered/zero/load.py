"""Pretrained weights streamed from safetensors shards into the groups' partitions at initialize.

[Note: streaming load]
``initialize(model, config, weights=folder)`` (and ``tiered.from_pretrained``) never holds the
model on the host: the model is usually built on the meta device, and while each group's
partitions are written (tiered/zero/sharding.py) only this rank's slice of that group is read
from the files, row block by row block (at most ``CHUNK_BYTES`` converted at a time), into one
fp32 shard buffer; the buffer is cast to the compute dtype and handed to the group's tier, then
dropped. A file is opened (``safe_open``, which memory-maps it) per group and closed after, so
the mapped pages read stay bounded by one group too. Host memory for loading is therefore one
group's shard in fp32 (+ its compute-dtype copy) + one chunk; that is checked against the CPU
budget before any partition is written.

The fp32 master the optimizer starts from is read again from the files, group by group, when
it takes it (``take_initial_fp32``), instead of being kept for every group from the first read:
keeping them would be the whole model in fp32 on the host. bf16 weights are upcast exactly.

Which files: with ``model.safetensors.index.json`` exactly the files its ``weight_map`` names
(a listed file that is missing is an error naming it; a ``*.safetensors`` it does not list is
ignored, with one log line). Without an index, when Hugging Face shard names are present
(``model.safetensors`` or ``model-00001-of-00003.safetensors``) only those are read and any
other file (a Mistral-style ``consolidated.safetensors``, an old copy) is ignored with one log
line; otherwise every ``*.safetensors`` is read, and a tensor found in two files is an error
naming both (never one silently overriding the other).

Checks, all before training: every file tensor names a parameter or buffer of the model with
the same shape (else an error naming the tensor and file: wrong config.json?); every parameter
is covered under one of its names (a tied ``lm_head.weight`` is covered by ``embed_tokens``),
else an error listing them unless ``init_missing=True``, which initialises them as a meta model
would be ([Note: meta materialisation]); a NaN or Inf read is an error naming the tensor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiered.config.user_files import kind_of
from tiered.errors import CapacityError, WeightsError
from tiered.zero.conversions import TensorSource, match_files

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20
"""fp32 bytes converted at a time while streaming one tensor's slice."""
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", torch.uint8),
    "F8_E5M2": getattr(torch, "float8_e5m2", torch.uint8),
}  # fmt: skip
"""safetensors' dtype names (a header's, read without loading the tensor)."""
_HF_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_UNREAD_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf", "*.bin.index.json")
"""Weight files of other formats, which tiered does not read: safetensors only, never a pickle."""


def unread_weight_files(folder: Path) -> list[str]:
    """Names of the weight files in `folder` that are not safetensors (PyTorch pickles, TF/Flax,
    GGUF): a folder holding only these must be refused, not trained from random weights."""
    return sorted({p.name for pattern in _UNREAD_WEIGHTS for p in folder.glob(pattern) if p.is_file()})


def convert_hint(folder: Path) -> str:
    """How to turn a folder of PyTorch .bin weights into safetensors once, with transformers."""
    return (
        'convert it once with transformers: python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{folder}').save_pretrained('{folder}-safetensors')\" and pass that folder"
    )


def quantization_method(folder: Path) -> str | None:
    """config.json's quantization method, None where it has none (or cannot be read: the
    config's reader says why)."""
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    if not isinstance(quant, dict):
        return None
    return str(quant.get("quant_method", "unknown"))


def quantized_message(method: str) -> str:
    return (
        f"a quantized checkpoint (config.json's quantization_config, quant_method {method!r}): its files hold "
        "packed integers and scales, not the weights tiered trains; pass the original (unquantized) model folder"
    )


def _check_regular(paths: Sequence[Path]) -> None:
    """Every weights file (and the index) that is there is a regular file: a FIFO would block the
    reader's open for ever, a device never end ([Note: files a user names])."""
    for p in paths:
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:
            continue  # a dangling link: the missing-shard error names it
        if not stat.S_ISREG(mode):
            raise WeightsError(
                f"weights file {p} is {kind_of(mode)}, not a regular file; remove it or replace it"
            )


def weight_files(folder: Path) -> tuple[list[Path], Path | None]:
    """The files to read ([Note: streaming load]) and the index they came from (None: no index)."""
    present = sorted(folder.glob("*.safetensors"))
    index = folder / INDEX_NAME
    _check_regular([*present, *([index] if os.path.lexists(index) else [])])
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(
                f"weights index {index} is not a valid JSON index with a weight_map ({exc}); fix or remove it"
            ) from None
        listed = sorted({str(v) for v in weight_map.values()})
        missing = [n for n in listed if not (folder / n).is_file()]
        if missing:
            raise WeightsError(
                f"weights index {index} lists shard(s) {missing} that are not in {folder}; "
                "the download is incomplete"
            )
        stray = [p.name for p in present if p.name not in listed]
        if stray:
            log.info("weights: %s not listed in %s: ignored", ", ".join(stray), INDEX_NAME)
        return [folder / n for n in listed], index
    hf = [p for p in present if _HF_SHARD.match(p.name)]
    if hf and len(hf) < len(present):
        stray = [p.name for p in present if p not in hf]
        log.info(
            "weights: no %s; reading the Hugging Face shards %s and ignoring %s",
            INDEX_NAME,
            ", ".join(p.name for p in hf),
            ", ".join(stray),
        )
        return hf, None
    return present, None


class WeightSource:
    """The tensors of one model folder: which file holds each, its shape and dtype (headers only)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise WeightsError(f"weights={folder}: not a folder; pass a Hugging Face model folder")
        files, index = weight_files(self.folder)
        if not files:
            other = unread_weight_files(self.folder)
            raise WeightsError(
                f"weights={folder}: no *.safetensors files in the folder"
                + (
                    f"; it holds {', '.join(other)}, which tiered does not read (safetensors only, no "
                    f"pickle is ever loaded): {convert_hint(self.folder)}"
                    if other
                    else ""
                )
            )
        quant = quantization_method(self.folder)
        if quant is not None:
            raise WeightsError(f"weights={folder}: {quantized_message(quant)}")
        from safetensors import safe_open

        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        if k in self.file_of:
                            raise WeightsError(
                                f"tensor {k} is in both {self.file_of[k].name} and {f.name} "
                                f"(folder {self.folder}, no index to choose): remove the stale file"
                            )
                        self.file_of[k] = f
                        sl = h.get_slice(k)
                        self.shapes[k] = tuple(sl.get_shape())
                        self.dtypes[k] = _DTYPES.get(sl.get_dtype(), torch.float32)
            except WeightsError:
                raise
            except Exception as exc:  # noqa: BLE001 - a corrupt file is the user's to fix
                raise WeightsError(f"weights file {f}: cannot read its safetensors header: {exc}") from None
        self.index = index
        log.info("weights: %d tensors in %d files under %s", len(self.file_of), len(files), self.folder)

    def _index_map(self) -> dict[str, str]:
        if self.index is None:
            return {}
        try:
            weight_map = json.loads(self.index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        return weight_map if isinstance(weight_map, dict) else {}

    def _listed_where(self, names: Sequence[str]) -> str:
        """Where the index says the first of `names` is, when it says so: that shard lacks it."""
        weight_map = self._index_map()
        for n in names:
            if n in weight_map:
                return f" ({INDEX_NAME} puts {n} in {weight_map[n]}, which lacks it: an incomplete or stale shard)"
        return ""

    def match(self, model: nn.Module) -> dict[str, TensorSource]:
        """Each model tensor the files give, and from which file tensors ([Note: file tensors by
        transformers' conversions]); errors name tensors and files."""
        found = match_files(
            model,
            self.shapes,
            str(self.folder),
            dtypes=self.dtypes,
            listed_in=lambda key: self._listed_where([key]),
            at=lambda key: f" (in {self.file_of[key].name})" if key in self.file_of else "",
            path_of=lambda key: str(self.file_of[key]) if key in self.file_of else str(self.folder),
        )
        return found.sources

    def plan(self, model: nn.Module, *, init_missing: bool) -> LoadPlan:
        """Match the files against `model` (names, shapes, coverage): see [Note: streaming load]."""
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers())
        sources = self.match(model)
        source_of: dict[int, TensorSource] = {}
        for name, p in params.items():
            src = sources.get(name)
            if src is None:
                continue
            first = source_of.setdefault(id(p), src)  # tied: the first name the files hold
            if first is not src:
                log.warning(
                    "weights: the model ties %s to %s (config.json), but the files hold both; the tied "
                    "parameter takes %s's values and the file's %s is unused: if they differ, set "
                    "tie_word_embeddings false in config.json to train them apart (transformers unties them)",
                    name,
                    first.name,
                    first.keys[0],
                    src.keys[0],
                )
        merged = sum(1 for s in source_of.values() if s.converted)
        if merged:
            log.info(
                "weights: %d parameters assembled from per-expert file tensors, as transformers merges them",
                merged,
            )
        missing = sorted({n for n, p in params.items() if id(p) not in source_of})
        if missing and not init_missing:
            raise WeightsError(
                f"weights in {self.folder} do not cover {len(missing)} parameters: {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}{self._listed_where(missing)}; complete the folder "
                "(in the Python API, init_missing=True initialises them with the model's own init)"
            )
        if missing:
            log.info(
                "weights: %d parameters not in the files are initialised: %s", len(missing), missing[:10]
            )
        return LoadPlan(
            self,
            source_of,
            sorted(
                (src.keys[0], name) for name, src in sources.items() if name in buffers and name not in params
            ),
        )


class LoadPlan:
    """Which file tensor fills each parameter (by id); reads slices of them. One per initialize."""

    def __init__(
        self, source: WeightSource, source_of: dict[int, TensorSource], buffer_keys: list[tuple[str, str]]
    ) -> None:
        self.source = source
        self.source_of = source_of
        """id(param) -> the file tensor(s) holding it; absent: initialised (init_missing)."""
        self.buffer_keys = buffer_keys
        """(file tensor, the model's buffer name) of each buffer the files hold."""
        self.pin = False
        """Shard buffers in page-locked memory (the gpu tier is a CUDA device: the copy to it is a DMA)."""

    def check_buffers_fit(
        self, shard_numels: Sequence[int], compute_dtype: torch.dtype, cpu_budget: int | None
    ) -> int:
        """The host bytes streaming needs (largest group's fp32 shard + its cast + one chunk);
        a CapacityError naming them when the CPU budget cannot hold them. Before any write."""
        cast = 0 if compute_dtype == torch.float32 else torch.empty(0, dtype=compute_dtype).element_size()
        need = max(shard_numels, default=0) * (4 + cast) + CHUNK_BYTES
        if cpu_budget is not None and need > cpu_budget:
            raise CapacityError(
                f"streaming weights from {self.source.folder} needs {need:,} bytes of host memory (the largest "
                f"group's shard in fp32{' and ' + str(compute_dtype) if cast else ''} + a {CHUNK_BYTES:,}-byte "
                f"chunk) but the cpu tier's budget is {cpu_budget:,} bytes; raise it or lower sub_group_size"
            )
        return need

    @contextmanager
    def _opened(self, keys: Sequence[str]) -> Iterator[dict[Path, Any]]:
        from safetensors import safe_open

        with ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for f in sorted({self.source.file_of[k] for k in keys}):
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            yield handles

    def fill_shard(
        self,
        slots: Sequence[tuple[str, nn.Parameter, int, int]],
        lo: int,
        numel: int,
        init_missing: Callable[[list[tuple[str, nn.Parameter]]], None],
    ) -> torch.Tensor:
        """Elements [lo, lo+numel) of the group's flat buffer (padding zero), in fp32, read from the
        files; `slots` are the group's entries (name, parameter, first element, elements: a piece of a
        fused parameter holds part of it); parameters the files do not cover are initialised by
        `init_missing` first."""
        return self._fill(slots, lo, numel, init_missing)

    def _fill(
        self,
        slots: Sequence[tuple[str, nn.Parameter, int, int]],
        lo: int,
        numel: int,
        init_missing: Callable[[list[tuple[str, nn.Parameter]]], None],
    ) -> torch.Tensor:
        out = torch.zeros(numel, dtype=torch.float32, pin_memory=self.pin)
        hi = lo + numel
        spans, off = [], 0  # (name, param, [a, b) of the parameter, where in `out`)
        for qual, p, start, n in slots:
            if off < hi and off + n > lo:
                a, b = start + max(lo, off) - off, start + min(hi, off + n) - off
                spans.append((qual, p, a, b, max(lo, off) - lo))
            off += n
        todo = list({id(p): (q, p) for q, p, *_ in spans if id(p) not in self.source_of}.values())
        if todo:
            init_missing(todo)
        keys = [k for _, p, *_ in spans if id(p) in self.source_of for k in self.source_of[id(p)].keys]
        with self._opened(keys) as handles:
            for _qual, p, a, b, at in spans:
                src = self.source_of.get(id(p))
                if src is None:
                    out[at : at + (b - a)].copy_(p.detach().reshape(-1)[a:b])
                    continue
                for run, r_lo, r_hi in src.runs_in(a, b):  # per file tensor: an expert's slice, or all of it
                    f = run.file_start + (r_lo - run.param_start)
                    self._read(
                        handles[self.source.file_of[run.key]],
                        run.key,
                        f,
                        f + (r_hi - r_lo),
                        out[at + r_lo - a : at + r_hi - a],
                    )
        return out

    def read_whole(self, p: nn.Parameter) -> torch.Tensor:
        """All of `p` in fp32, read from the files (a model loaded whole: LoRA, --compare-torch)."""
        return self._fill([("", p, 0, p.numel())], 0, p.numel(), _already_initialised).view(p.shape)

    def _read(self, h: Any, key: str, a: int, b: int, dst: torch.Tensor) -> None:
        """Flat elements [a, b) of tensor `key` into `dst` (fp32), converted CHUNK_BYTES at a time."""
        shape = self.source.shapes[key]
        if len(shape) == 0:
            t = h.get_tensor(key).reshape(-1)[a:b]
            self._finite(key, t)
            dst.copy_(t)
            return
        row = math.prod(shape[1:])
        rows_per_chunk = max(1, CHUNK_BYTES // (4 * max(row, 1)))
        sl = h.get_slice(key)
        r = a // row
        while r * row < b:
            r2 = min(r + rows_per_chunk, -(-b // row))
            t = sl[r:r2].reshape(-1)
            s, e = max(a, r * row) - r * row, min(b, r2 * row) - r * row
            t = t[s:e]
            self._finite(key, t)
            dst[max(a, r * row) - a : max(a, r * row) - a + (e - s)].copy_(t)
            r = r2

    def _finite(self, key: str, t: torch.Tensor) -> None:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WeightsError(
                f"tensor {key} in {self.source.file_of[key]} holds NaN or Inf values; the weights are "
                "corrupt (training would diverge from the first step)"
            )

    def load_buffers(self, model: nn.Module) -> None:
        """Buffers the files hold (e.g. an old checkpoint's rotary inv_freq): copied in place."""
        if not self.buffer_keys:
            return
        buffers = dict(model.named_buffers())
        with self._opened([k for k, _ in self.buffer_keys]) as handles, torch.no_grad():
            for k, name in self.buffer_keys:
                t = handles[self.source.file_of[k]].get_tensor(k)
                if tuple(t.shape) != tuple(buffers[name].shape):
                    raise WeightsError(
                        f"tensor {k} in {self.source.file_of[k].name} has shape {tuple(t.shape)}, the model's buffer "
                        f"{name} is {tuple(buffers[name].shape)}; do the weights belong to this config.json?"
                    )
                self._finite(k, t)
                buffers[name].copy_(t.to(buffers[name].dtype))

    def initial_fp32(
        self, slots: Sequence[tuple[str, nn.Parameter, int, int]], lo: int, numel: int
    ) -> Callable[[], torch.Tensor]:
        """The group's fp32 master shard, read again from the files when the optimizer takes it."""
        slots = list(slots)  # (the sizes are numbers: the parameters are emptied after the write)

        def read() -> torch.Tensor:
            return self._fill(slots, lo, numel, _already_initialised)

        return read


def _already_initialised(todo: list[tuple[str, nn.Parameter]]) -> None:
    raise WeightsError(
        f"parameters {[q for q, _ in todo][:5]} were initialised (init_missing) in low precision only; "
        "their fp32 master cannot be read from the files"
    )
