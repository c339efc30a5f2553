"""Saving and loading an engine's full training state, partition by partition, any world size.

[Note: checkpoint layout]
Each rank writes one file ``rank<r>.safetensors`` holding, per shard group of its own, the
compute-dtype parameter shard (``<group>.param``) and, for a trainable group, the fp32 master
(``<group>.master``; absent where the parameter partition is the master, see [Note: fp32 master
is the parameter]), ``<group>.exp_avg`` and ``<group>.exp_avg_sq``, plus its RNG tensors. The
manifest maps every parameter, by its qualified name, to the pieces that hold it: (rank, group,
start in that shard, start in the flattened parameter, length). A load on any world size (and
any sub_group_size or placement) rebuilds each of its own shards from those pieces' byte ranges
(read from the files' safetensors headers), one shard at a time and chunk by chunk
([Note: checkpoint partition I/O]), so resharding needs no conversion step
(DeepSpeed's "universal checkpoint"). Padding elements are zero, as at initialisation.

The ranks agree through files, not pickled objects: each writes ``rank<r>.json`` (its layout,
file record and RNG state) into the shared staging directory, and after an all-reduce that says
every rank succeeded, rank 0 folds them into manifest.json and publishes (see
[Note: atomic checkpoint]). A failure on any rank aborts the save on all of them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from tiered.checkpoint import directory as d
from tiered.checkpoint import rng
from tiered.checkpoint.decode_load import MomentDecoder, SavedMoment, decoding_filler, saved_moment
from tiered.checkpoint.manifest_layout import check_engine_layout
from tiered.checkpoint.partition_io import Segment, fill_partition, load_partition, read_chunks
from tiered.checkpoint.pipeline import ChunkPipeline
from tiered.checkpoint.stream import TensorSpec, dtype_code, file_bytes, tensor_ranges, verify_file
from tiered.checkpoint.writer import DEFAULT_CHUNK_BYTES, CheckpointWriter
from tiered.errors import CheckpointCorruptError, CheckpointMismatchError

log = logging.getLogger(__name__)

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
CHUNK_BYTES = DEFAULT_CHUNK_BYTES
"""Bytes per pipeline buffer of a save or load ([Note: checkpoint chunk pipeline]), read per call."""
_IGNORED_CONFIG_PREFIXES = ("tiered.tiers", "tiered.trace_path", "tiered.timeout_s", "tiered.io_threads")


@dataclass(frozen=True)
class GroupState:
    """What a checkpoint needs of one shard group: its layout (a `ShardGroup`) and the
    partitions holding its bytes, by kind: "param", and for a trainable group "master",
    "exp_avg", "exp_avg_sq" ("master" may be the "param" partition itself)."""

    group: Any
    parts: dict[str, Any]


@dataclass(frozen=True)
class Collective:
    """The few collectives a multi-rank save and load need (no-ops on one rank)."""

    rank: int = 0
    world_size: int = 1
    process_group: Any = None

    def _dev(self) -> str:
        import torch.distributed as dist

        return "cuda" if dist.get_backend(self.process_group) == "nccl" else "cpu"

    def all_sum(self, n: int) -> int:
        if self.world_size == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64, device=self._dev())
        dist.all_reduce(t, group=self.process_group)
        return int(t.item())

    def any(self, flag: bool) -> bool:
        return self.all_sum(int(bool(flag))) > 0

    def barrier(self) -> None:
        self.all_sum(0)


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _tensor_names(gs: GroupState) -> dict[str, str]:
    g = gs.group
    names = {"param": f"{g.name}.param"}
    for kind in STATE_KINDS if "exp_avg" in gs.parts else ():
        src = "param" if gs.parts[kind] is gs.parts["param"] else kind
        names[kind] = f"{g.name}.{src}"
    return names


def tiles_of(parts: Any) -> list[tuple[int, Any]]:
    """(start in the shard, partition) of each tile holding one kind of a group's state: the
    partition itself, or the tiles' partitions in shard order where the optimizer steps the group
    in tiles (see [Note: sub-group pipeline] in tiered/optim/offload.py). The checkpoint holds
    one tensor per kind either way."""
    if not isinstance(parts, tuple):
        return [(0, parts)]
    out, start = [], 0
    for p in parts:
        out.append((start, p))
        start += p.numel
    return out


def _tile_bytes(gs: GroupState) -> list[int]:
    """Bytes of each tile of the group's exp_avg (empty for a frozen group): what a byte-coded
    moment format (int8, [Note: compressed optimizer state]) needs to load into the same tiling."""
    if "exp_avg" not in gs.parts:
        return []
    return [t.nbytes for _, t in tiles_of(gs.parts["exp_avg"])]


def _blob_copies(
    g: Any,
    kind: str,
    part: Any,
    tensors_of: dict[tuple[int, str], dict[str, str]],
    layouts: dict[tuple[int, str], dict[str, Any]],
    path: str,
    rank: int,
) -> list[tuple[Any, list[tuple[int, int, int, str, int]]]]:
    """Per tile of `part` (a moment stored as bytes, not by element: block codes), its bytes from
    the same rank's same group in the checkpoint, refused by name unless that was stepped in the
    same tiles (its block scales are per tile)."""
    key = (rank, g.name)
    saved = layouts.get(key)
    mine = [t.nbytes for _, t in tiles_of(part)]
    if saved is None or saved.get("tile_bytes") != mine or saved.get("shard_numel") != g.shard_numel:
        raise CheckpointMismatchError(
            f"checkpoint {path}: the {kind} of group {g.name} is stored as block codes (int8), which "
            f"load only into the same world size, groups and sub_group_size tiles; this run's rank "
            f"{rank} has tiles of {mine} bytes, the checkpoint "
            f"{None if saved is None else saved.get('tile_bytes')}. Resume with the saved layout, or with "
            "tiered.optimizer_state_format 'fp32' (the moments decoded exactly, on any layout)"
        )
    out, off = [], 0
    for _, t in tiles_of(part):
        out.append((t, [(0, off, t.numel, tensors_of[key][kind], rank)]))
        off += t.numel
    return out


def _written(gs: GroupState) -> list[tuple[str, Any]]:
    """(tensor name, partition) of each distinct partition of the group, in file order."""
    out, seen = [], set()
    for kind, name in _tensor_names(gs).items():
        if name not in seen:
            seen.add(name)
            out.append((name, gs.parts[kind]))
    return out


def _pieces(groups: Sequence[GroupState], rank: int) -> dict[str, list[dict[str, int | str]]]:
    pieces: dict[str, list[dict[str, int | str]]] = {}
    for gs in groups:
        g = gs.group
        for e in g.entries:
            sl = g.shard_slice(e)
            if sl is not None:
                pieces.setdefault(e.name, []).append(
                    {
                        "rank": rank,
                        "group": g.name,
                        "start_in_shard": sl[0],
                        "start_in_param": sl[1],
                        "length": sl[2],
                    }
                )
    return pieces


def save_engine_state(
    tm: Any,
    groups: Sequence[GroupState],
    save_dir: str | os.PathLike[str],
    tag: str,
    *,
    body: dict[str, Any],
    comm: Collective,
    chunk_bytes: int | None = None,
    save_latest: bool = True,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write checkpoint `tag`: this rank's shards streamed from their tiers, then (rank 0) the
    manifest with `body` (config, counters, client_state, ...). See [Note: checkpoint layout].
    `extra_tensors` (host tensors, e.g. client_state's) go into this rank's file by name."""
    rank = comm.rank
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    rng_json, rng_tensors = rng.capture()
    small = {**rng_tensors, **(extra_tensors or {})}
    written = [(n, p) for gs in groups for n, p in _written(gs)]
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in small.items()]
    specs += [
        TensorSpec(n, tiles_of(p)[0][1].dtype, (sum(t.numel for _, t in tiles_of(p)),)) for n, p in written
    ]
    flat = [t for _, p in written for _, t in tiles_of(p)]
    need = comm.all_sum(file_bytes(specs))
    w = CheckpointWriter(save_dir, tag, owner=rank == 0)
    failed: BaseException | None = None
    try:
        if rank == 0:
            w.begin(need)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the collective below
        failed = e
    if comm.any(failed is not None):
        _raise_or_abort(failed, w, "prepare")
    try:
        # a host bounce buffer only where some tier's bytes live on a device (a real GPU)
        on_device = any(
            str(tm.tier(t).backend.capabilities.device) != "cpu"
            for t in tm.tier_names
            if tm.tier(t).backend.capabilities.memory_like
        )
        with ChunkPipeline(_buffer_bytes(chunk_bytes, flat)) as pipe:
            buf = torch.empty(pipe.chunk_bytes, dtype=torch.uint8, pin_memory=True) if on_device else None

            def chunks() -> Iterator[torch.Tensor]:
                yield from small.values()
                for part in flat:
                    yield from read_chunks(tm, part, pipe, buf)

            rec = w.write_file(rank_file(rank), specs, chunks(), {"format": d.FORMAT, "rank": str(rank)})
        layout = {
            "rank": rank,
            "file": rank_file(rank),
            "record": rec,
            "rng": rng_json,
            "groups": [
                {
                    "name": gs.group.name,
                    "full_numel": gs.group.full_numel,
                    "shard_numel": gs.group.shard_numel,
                    "shard_offset": gs.group.shard_offset,
                    "tensors": _tensor_names(gs),
                    "tile_bytes": _tile_bytes(gs),
                }
                for gs in groups
            ],
            "pieces": _pieces(groups, rank),
        }
        d.write_json_durably(os.path.join(w.staging, f"rank{rank:05d}.json"), layout)
    except BaseException as e:  # noqa: BLE001
        failed = e
    if comm.any(failed is not None):
        _raise_or_abort(failed, w, "write")
    path = None
    try:
        if rank == 0:
            files = _rank_files(w.staging, comm.world_size)
            path = w.commit(_manifest(w.staging, body, comm.world_size), files=files, save_latest=save_latest)
    except BaseException as e:  # noqa: BLE001
        failed = e
    if comm.any(failed is not None):
        _raise_or_abort(failed, w, "publish")
    return path or os.path.join(w.save_dir, w.tag)


def _buffer_bytes(chunk_bytes: int, parts: Sequence[Any]) -> int:
    """Pipeline buffers no larger than the largest partition: small models need no 16 MiB ones."""
    return max(1, min(chunk_bytes, max((p.nbytes for p in parts), default=1)))


def _raise_or_abort(failed: BaseException | None, w: CheckpointWriter, stage: str) -> None:
    w.abort()
    if failed is not None:
        raise failed
    raise RuntimeError(
        f"checkpoint {w.tag}: another rank failed to {stage} its part of the save (see its log); "
        "the previous checkpoint and 'latest' are unchanged"
    )


def check_json(obj: Any, what: str = "client_state") -> None:
    """Raise ValueError naming the first entry of `obj` that JSON cannot hold (no pickle)."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(f"{what}: key {k!r} is not a string; checkpoints store client_state as JSON")
            check_json(v, f"{what}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_json(v, f"{what}[{i}]")
        return
    raise ValueError(
        f"{what} holds a {type(obj).__name__}: checkpoints store client_state as JSON (numbers, "
        "strings, lists, dicts; no pickle); convert it (e.g. tensor.tolist()) or save it yourself"
    )


def _rank_layouts(staging: str, world_size: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world_size):
        with open(os.path.join(staging, f"rank{r:05d}.json"), encoding="utf-8") as f:
            out.append(json.load(f))
    return out


def _rank_files(staging: str, world_size: int) -> dict[str, dict[str, Any]]:
    return {lay["file"]: lay["record"] for lay in _rank_layouts(staging, world_size)}


def _manifest(staging: str, body: dict[str, Any], world_size: int) -> dict[str, Any]:
    layouts = _rank_layouts(staging, world_size)
    params: dict[str, dict[str, Any]] = {}
    for spec in body.pop("parameter_specs"):
        params[spec["name"]] = {"shape": spec["shape"], "trainable": spec["trainable"], "pieces": []}
    for lay in layouts:
        for name, ps in lay.pop("pieces").items():
            params[name]["pieces"].extend(ps)
        lay.pop("record")
    for r in range(world_size):
        os.remove(os.path.join(staging, f"rank{r:05d}.json"))
    return {**body, "world_size": world_size, "ranks": layouts, "parameters": params}


def parameter_specs(groups: Sequence[GroupState]) -> list[dict[str, Any]]:
    """Name, shape and trainability of every parameter, as the manifest records them."""
    return [  # (a parameter in pieces over several groups is one parameter: its first piece's entry)
        {"name": e.name, "shape": list(e.shape), "trainable": bool(gs.group.trainable)}
        for gs in groups
        for e in gs.group.entries
        if e.start == 0
    ]


# ---- load ----------------------------------------------------------------------------------
def check_compatible(
    manifest: dict[str, Any],
    specs: list[dict[str, Any]],
    compute_dtype: str,
    config: dict[str, Any],
    path: str,
) -> None:
    """Raise CheckpointMismatchError naming what differs between checkpoint `path` and this
    engine (parameters, shapes, trainability, compute dtype); warn about other config changes."""
    saved = manifest["parameters"]
    mine = {s["name"]: s for s in specs}
    problems = []
    missing = [n for n in mine if n not in saved]
    extra = [n for n in saved if n not in mine]
    if missing:
        problems.append(f"{len(missing)} parameters of this model are not in it ({', '.join(missing[:5])})")
    if extra:
        problems.append(f"it has {len(extra)} parameters this model lacks ({', '.join(extra[:5])})")
    shapes = [
        f"{n}: {tuple(saved[n]['shape'])} in the checkpoint, {tuple(s['shape'])} here"
        for n, s in mine.items()
        if n in saved and list(saved[n]["shape"]) != list(s["shape"])
    ]
    if shapes:
        problems.append("shapes differ: " + "; ".join(shapes[:5]))
    frozen = [
        f"{n} ({'trainable' if saved[n]['trainable'] else 'frozen'} in the checkpoint)"
        for n, s in mine.items()
        if n in saved and bool(saved[n]["trainable"]) != s["trainable"]
    ]
    if frozen:
        problems.append("requires_grad differs: " + ", ".join(frozen[:5]))
    if manifest.get("compute_dtype") != compute_dtype:
        problems.append(
            f"compute dtype {manifest.get('compute_dtype')} in the checkpoint, {compute_dtype} here "
            "(bf16.enabled / fp16.enabled)"
        )
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit this engine: "
            + "; ".join(problems)
            + ". Load it into the model and config it was saved from"
        )
    for n, info in saved.items():
        numel = 1
        for x in info["shape"]:
            numel *= int(x)
        if sum(int(p["length"]) for p in info["pieces"]) != numel:
            raise CheckpointCorruptError(f"checkpoint {path}: the manifest's pieces of {n} do not cover it")
    diffs = _config_diffs(manifest.get("config", {}), config)
    if diffs:
        log.warning(
            "resuming %s with a config that differs from the saved one: %s", path, "; ".join(diffs[:20])
        )


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def _config_diffs(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    a, b = _flatten(saved), _flatten(now)
    out = []
    for k in sorted(set(a) | set(b)):
        if k.startswith(_IGNORED_CONFIG_PREFIXES) or k.endswith("nvme_path"):
            continue
        if a.get(k) != b.get(k):
            out.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return out


def read_rank_tensors(
    path: str, manifest: dict[str, Any], rank: int, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The named tensors `save_engine_state` put into rank `rank`'s file as `extra_tensors`."""
    if not names:
        return {}
    from safetensors import safe_open

    lay = next(lay for lay in manifest["ranks"] if lay["rank"] == rank)
    fname = lay["file"]
    verify_file(os.path.join(path, fname), manifest["files"][fname])
    with safe_open(os.path.join(path, fname), "pt") as f:
        have = set(f.keys())
        missing = [n for n in names if n not in have]
        if missing:
            raise CheckpointCorruptError(
                f"checkpoint {path}: {fname} lacks {missing[:3]} (its manifest names them)"
            )
        return {n: f.get_tensor(n) for n in names}


def open_checkpoint(load_dir: str | os.PathLike[str], tag: str | None) -> tuple[str, dict[str, Any]]:
    path = d.resolve(os.fspath(load_dir), tag)
    manifest = d.read_manifest(path)
    check_engine_layout(os.path.join(path, d.MANIFEST), manifest)  # [Note: manifest layout checked on read]
    return path, manifest


def load_engine_state(
    tm: Any,
    groups: Sequence[GroupState],
    path: str,
    manifest: dict[str, Any],
    *,
    comm: Collective,
    decode: Mapping[str, MomentDecoder] | None = None,
) -> None:
    """Fill every partition of `groups` from checkpoint `path` (checked compatible first) and
    restore this rank's RNG states. See [Note: checkpoint layout]. `decode`: the saved format's
    codec of each moment ("exp_avg", "exp_avg_sq") where they load decoded into fp32
    (tiered/checkpoint/decode_load.py)."""
    from safetensors import safe_open

    ranks = {lay["rank"]: lay for lay in manifest["ranks"]}
    tensors_of = {(lay["rank"], g["name"]): g["tensors"] for lay in manifest["ranks"] for g in lay["groups"]}
    layouts = {(lay["rank"], g["name"]): g for lay in manifest["ranks"] for g in lay["groups"]}
    decode = decode or {}
    plan: list[tuple[Any, str, list[tuple[int, int, int, str, int]]]] = []
    need_files: set[int] = set()
    for gs in groups:
        g = gs.group
        for kind, part in gs.parts.items():
            if kind == "master" and part is gs.parts["param"]:
                continue  # the param partition is the master: filled as "param"
            if kind in ("exp_avg", "exp_avg_sq") and tiles_of(part)[0][1].dtype == torch.uint8:
                for tile, copies in _blob_copies(g, kind, part, tensors_of, layouts, path, comm.rank):
                    plan.append((tile, kind, copies))
                    need_files.add(comm.rank)
                continue
            copies = []
            for e in g.entries:
                sl = g.shard_slice(e)
                if sl is None:
                    continue
                s_shard, s_param, n = sl
                for p in manifest["parameters"][e.name]["pieces"]:
                    lo = max(s_param, int(p["start_in_param"]))
                    hi = min(s_param + n, int(p["start_in_param"]) + int(p["length"]))
                    if hi <= lo:
                        continue
                    src_name = tensors_of[(int(p["rank"]), p["group"])][kind]
                    src_off = int(p["start_in_shard"]) + lo - int(p["start_in_param"])
                    copies.append((s_shard + lo - s_param, src_off, hi - lo, src_name, int(p["rank"])))
                    need_files.add(int(p["rank"]))
            for start, tile in tiles_of(part):  # each tile takes the copies' bytes that fall in it
                plan.append((tile, kind, _within(copies, start, start + tile.numel)))
    own = comm.rank if comm.rank in ranks else None
    if own is not None:
        need_files.add(own)
    for r in sorted(need_files):
        fname = ranks[r]["file"]
        verify_file(os.path.join(path, fname), manifest["files"][fname])
    ranges = {r: tensor_ranges(os.path.join(path, ranks[r]["file"])) for r in sorted(need_files)}
    with ExitStack() as stack:
        fds = {}
        for r in sorted(need_files):
            fds[r] = os.open(os.path.join(path, ranks[r]["file"]), os.O_RDONLY)
            stack.callback(os.close, fds[r])
            os.posix_fadvise(fds[r], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pipe = stack.enter_context(ChunkPipeline(_buffer_bytes(CHUNK_BYTES, [p for p, _, _ in plan])))
        sources: dict[tuple[int, str], SavedMoment] = {}
        saved_groups = {(r, t): g for (r, _), g in layouts.items() for t in g["tensors"].values()}
        for part, kind, copies in plan:
            if kind in decode:
                for c in copies:
                    if (c[4], c[3]) not in sources:
                        sources[(c[4], c[3])] = saved_moment(
                            decode[kind], saved_groups[(c[4], c[3])],
                            ranges[c[4]].get(c[3]), fds[c[4]], path, c[3],
                        )  # fmt: skip
                fill_partition(tm, part, decoding_filler(copies, sources), pipe)
                continue
            segments = [_segment(path, ranks[c[4]]["file"], ranges[c[4]], part, c, fds[c[4]]) for c in copies]
            load_partition(tm, part, segments, pipe, f"checkpoint {path}, partition {part.name!r}")
        if manifest["world_size"] != comm.world_size:
            log.warning(
                "checkpoint %s was saved by %d ranks and loads on %d: %s",
                path,
                manifest["world_size"],
                comm.world_size,
                f"this rank's RNG states are those of saved rank {comm.rank}"
                if own is not None
                else f"rank {comm.rank} keeps its RNG states (none saved)",
            )
        if own is not None:
            lay = ranks[own]
            with safe_open(os.path.join(path, lay["file"]), "pt") as f:
                rng.restore(lay["rng"], {k: f.get_tensor(k) for k in lay["rng"]["tensors"]})


def _within(
    copies: list[tuple[int, int, int, str, int]], start: int, stop: int
) -> list[tuple[int, int, int, str, int]]:
    """The parts of `copies` (destination offsets in the shard) inside [start, stop), with
    destinations relative to `start`."""
    out = []
    for dst, src_off, n, name, rank in copies:
        lo, hi = max(dst, start), min(dst + n, stop)
        if lo < hi:
            out.append((lo - start, src_off + lo - dst, hi - lo, name, rank))
    return out


def _segment(
    path: str, fname: str, ranges: dict[str, Any], part: Any, copy: tuple[int, int, int, str, int], fd: int
) -> Segment:
    """The bytes of one piece of `part` in checkpoint file `fname`, checked against its header."""
    dst, src_off, n, src_name, _ = copy
    st = ranges.get(src_name)
    if st is None:
        raise CheckpointCorruptError(
            f"checkpoint {path}: {fname} has no tensor {src_name} (its manifest names it)"
        )
    if st.dtype != dtype_code(part.dtype):
        raise CheckpointCorruptError(f"checkpoint {path}: {src_name} is {st.dtype}, expected {part.dtype}")
    es = torch.empty(0, dtype=part.dtype).element_size()
    if (src_off + n) * es > st.end - st.start:
        raise CheckpointCorruptError(
            f"checkpoint {path}: the manifest's piece [{src_off}, {src_off + n}) of {src_name} lies past "
            f"its {(st.end - st.start) // es} elements in {fname}"
        )
    return Segment(dst * es, n * es, fd, st.start + src_off * es)
