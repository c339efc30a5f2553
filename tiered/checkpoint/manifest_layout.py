"""An engine checkpoint's manifest, checked whole before a loader indexes into it.

[Note: manifest layout checked on read]
The manifest checksum ([Note: manifest checksum]) detects an edit, not a forger, and a format
version 1 manifest has none. So before `load_engine_state`, `read_parameters` or any other reader
follows a name in it, the layout the loaders index is checked once, here: every rank's ``file``
is one of the files the manifest lists (so a path such as ``/etc/passwd`` or ``../other`` never
reaches ``os.path.join``), ranks are the integers 0 .. world_size-1 once each, every piece names
a saved rank and a group that rank saved, and every count is a non-negative integer. A manifest
that is not so is refused as corrupt, naming the file and the field, instead of a KeyError or
TypeError from deep in the loader. The per-file checksums and the tensor headers are checked
where the bytes are read ([Note: checkpoint checksum]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiered.errors import CheckpointCorruptError


class _Fields:
    """Typed reads of one object of the manifest; a wrong type or a missing key is a
    CheckpointCorruptError naming the manifest and the field's path."""

    def __init__(self, mpath: str, obj: Any, where: str) -> None:
        if not isinstance(obj, Mapping):
            raise _corrupt(mpath, where, f"is {type(obj).__name__}, not an object")
        self.mpath, self.obj, self.where = mpath, obj, where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self.obj:
            raise _corrupt(self.mpath, self.path(key), "is missing")
        value = self.obj[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise _corrupt(self.mpath, self.path(key), f"is {value!r}, not {_kind_name(kind)}")
        return value

    def count(self, key: str, minimum: int = 0) -> int:
        value = int(self.get(key, int))
        if value < minimum:
            raise _corrupt(self.mpath, self.path(key), f"is {value}, below {minimum}")
        return value

    def sub(self, key: str) -> _Fields:
        return _Fields(self.mpath, self.get(key, Mapping), self.path(key))


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({"Mapping": "an object", "list": "a list", "str": "a string", "int": "an integer"}.get(
        k.__name__, k.__name__
    ) for k in kinds)  # fmt: skip


def _corrupt(mpath: str, field: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint manifest {mpath}: {field} {what}; tiered did not write it so (edited or corrupt): "
        "load another checkpoint"
    )


def check_engine_layout(mpath: str, manifest: Mapping[str, Any]) -> None:
    """[Note: manifest layout checked on read] for the manifest `mpath` of an engine checkpoint."""
    top = _Fields(mpath, manifest, "")
    files = top.get("files", Mapping)
    for name in files:
        _Fields(mpath, files[name], f"files[{name!r}]").count("bytes")
    world = top.count("world_size", 1)
    ranks = top.get("ranks", list)
    groups_of: dict[int, set[str]] = {}
    for i, raw in enumerate(ranks):
        lay = _Fields(mpath, raw, f"ranks[{i}]")
        rank = lay.count("rank")
        if rank >= world or rank in groups_of:
            raise _corrupt(mpath, lay.path("rank"), f"is {rank}: ranks are 0 .. {world - 1}, each once")
        fname = lay.get("file", str)
        if fname not in files:
            raise _corrupt(
                mpath, lay.path("file"), f"names {fname!r}, which is not one of the files the manifest lists"
            )
        for tensor in lay.sub("rng").get("tensors", list):
            if not isinstance(tensor, str):
                raise _corrupt(mpath, lay.path("rng.tensors"), f"holds {tensor!r}, not a tensor name")
        groups_of[rank] = set()
        for j, graw in enumerate(lay.get("groups", list)):
            g = _Fields(mpath, graw, f"{lay.where}.groups[{j}]")
            groups_of[rank].add(g.get("name", str))
            for key in ("full_numel", "shard_numel", "shard_offset"):
                g.count(key)
            for kind, tensor in g.get("tensors", Mapping).items():
                if not isinstance(tensor, str):
                    raise _corrupt(mpath, g.path(f"tensors.{kind}"), f"is {tensor!r}, not a tensor name")
    for name, raw in top.get("parameters", Mapping).items():
        info = _Fields(mpath, raw, f"parameters[{name!r}]")
        for x in info.get("shape", list):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise _corrupt(mpath, info.path("shape"), f"holds {x!r}, not a size")
        info.get("trainable", bool)
        for k, praw in enumerate(info.get("pieces", list)):
            piece = _Fields(mpath, praw, f"{info.where}.pieces[{k}]")
            rank = piece.count("rank")
            group = piece.get("group", str)
            if group not in groups_of.get(rank, ()):
                raise _corrupt(
                    mpath,
                    piece.where,
                    f"names group {group!r} of rank {rank}, which the manifest's ranks do not hold",
                )
            for key in ("start_in_param", "start_in_shard", "length"):
                piece.count(key)
