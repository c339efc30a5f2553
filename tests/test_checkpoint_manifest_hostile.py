"""Manifests a forger or an older format wrote (issue 37, item 5): a rewrite to format version 1
(which has no checksum) is refused unless the user asks for version 1; every name and count a
loader follows is checked first ([Note: manifest layout checked on read]); and a file or folder
this user cannot read is named with the user, not taken for a missing or corrupt checkpoint.

Tests run as root here, where a mode does not stop a read: the permission tests run their reads
in a forked child that gave up root (uid/gid 65534) first (hostile_support.as_other_user), so
they hold for any user; one more injects the OS's PermissionError instead."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import CASES, build, ds_config, make_batches
from hostile_support import as_other_user, readable_tree

import tiered
from tiered.checkpoint import find_latest_valid, read_parameters, save_tensors
from tiered.checkpoint.directory import manifest_digest
from tiered.errors import CheckpointCorruptError, CheckpointPathError, ConfigError


def _checkpoint(tmp_path: Path) -> Path:
    case = CASES["mlp"]
    with tiered.initialize(build(case), ds_config(param="cpu", opt="cpu")) as e:
        e.backward(e(**make_batches(case, 1, 4)[0]))
        e.step()
        return Path(e.save_checkpoint(tmp_path / "ck"))


def _forge(tag: Path, edit: Callable[[dict[str, Any]], None], *, checksum: bool = True) -> None:
    m = json.loads((tag / "manifest.json").read_text())
    edit(m)
    m.pop("manifest_xxh3_64", None)
    if checksum:  # a forger recomputes it
        m["manifest_xxh3_64"] = manifest_digest(m)
    (tag / "manifest.json").write_text(json.dumps(m))


def _engine() -> Any:
    return tiered.initialize(build(CASES["mlp"]), ds_config(param="cpu", opt="cpu"))


def test_a_manifest_rewritten_to_version_1_is_refused_unless_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tag = _checkpoint(tmp_path)

    def downgrade(m: dict[str, Any]) -> None:
        m["format_version"] = 1
        m["training"]["global_steps"] += 5  # the edit a missing checksum would let through

    _forge(tag, downgrade, checksum=False)
    with _engine() as e:
        with pytest.raises(CheckpointCorruptError, match="format version 1 has no manifest checksum") as info:
            e.load_checkpoint(tmp_path / "ck")
        assert "TIERED_ACCEPT_CHECKPOINT_FORMAT=1" in str(info.value)
        assert e.global_steps == 0
        monkeypatch.setenv("TIERED_ACCEPT_CHECKPOINT_FORMAT", "1")  # the user asks for version 1
        e.load_checkpoint(tmp_path / "ck")
        assert e.global_steps == 6 and "has no manifest checksum" in caplog.text
    monkeypatch.setenv("TIERED_ACCEPT_CHECKPOINT_FORMAT", "2")
    with pytest.raises(ConfigError, match="TIERED_ACCEPT_CHECKPOINT_FORMAT='2'"):
        read_parameters(str(tmp_path / "ck"))


@pytest.mark.parametrize("version", [True, "2", 2.0, None])
def test_a_format_version_that_is_no_version_number_is_refused(tmp_path: Path, version: Any) -> None:
    tag = _checkpoint(tmp_path)
    _forge(tag, lambda m: m.update(format_version=version), checksum=False)
    with pytest.raises(CheckpointCorruptError, match=f"format_version {version!r}"):
        read_parameters(str(tmp_path / "ck"))


def _first_piece(m: dict[str, Any]) -> dict[str, Any]:
    piece: dict[str, Any] = next(iter(m["parameters"].values()))["pieces"][0]
    return piece


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m["ranks"][0].update(file="/etc/passwd"), "ranks[0].file names '/etc/passwd'"),
        (
            lambda m: m["ranks"][0].update(file="../other/rank00000.safetensors"),
            "ranks[0].file names '../other/",
        ),
        (lambda m: m.update(ranks=5), "ranks is 5, not a list"),
        (lambda m: m["ranks"][0].update(rank=3), "ranks[0].rank is 3: ranks are 0 .. 0"),
        (lambda m: m.update(world_size=0), "world_size is 0, below 1"),
        (
            lambda m: _first_piece(m).update(start_in_shard="abc"),
            ".pieces[0].start_in_shard is 'abc', not an integer",
        ),
        (lambda m: _first_piece(m).update(length=-4), ".pieces[0].length is -4, below 0"),
        (lambda m: _first_piece(m).update(group="g9999"), "names group 'g9999' of rank 0"),
        (
            lambda m: m["ranks"][0]["groups"][0]["tensors"].update(param=7),
            ".tensors.param is 7, not a tensor name",
        ),
        (
            lambda m: m["files"]["rank00000.safetensors"].pop("bytes"),
            "files['rank00000.safetensors'].bytes is missing",
        ),
    ],
    ids=[
        "etc-passwd",
        "dotdot",
        "ranks-5",
        "rank-3",
        "world-0",
        "offset-text",
        "length-negative",
        "group",
        "tensor",
        "bytes",
    ],
)
def test_a_forged_layout_is_refused_naming_the_field_before_any_file_is_opened(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], field: str
) -> None:
    tag = _checkpoint(tmp_path)
    _forge(tag, edit)
    for load in (
        lambda: read_parameters(str(tmp_path / "ck")),
        lambda: _engine().load_checkpoint(tmp_path / "ck"),
    ):
        with pytest.raises(CheckpointCorruptError) as info:
            load()
        assert f"checkpoint manifest {tag / 'manifest.json'}: " in str(info.value) and field in str(
            info.value
        )


# ---- permissions -----------------------------------------------------------------------------
@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder another user can reach (pytest's own is 0700 under root's)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="tiered-perm-"))
    os.chmod(d, 0o755)
    yield d
    import shutil

    for dirpath, dirs, _ in os.walk(d):
        for n in dirs:
            os.chmod(os.path.join(dirpath, n), 0o755)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
    "unreadable, named",
    [
        (lambda tag: tag / "manifest.json", "manifest.json"),
        (lambda tag: tag, "global_step1"),
        (lambda tag: tag / "rank00000.safetensors", "rank00000.safetensors"),
        (lambda tag: tag.parent / "latest", "latest"),
    ],
    ids=["manifest", "tag-folder", "rank-file", "latest"],
)
def test_an_unreadable_checkpoint_names_the_path_and_the_user(
    shared_tmp: Path, unreadable: Callable[[Path], Path], named: str
) -> None:
    tag = _checkpoint(shared_tmp)
    readable_tree(shared_tmp)
    target = unreadable(tag)
    os.chmod(target, 0)
    got = as_other_user(lambda: f"returned {read_parameters(str(shared_tmp / 'ck'))}")
    assert got.startswith(f"raw {CheckpointPathError.__name__}"), got
    assert f"checkpoint path {target}: permission denied for user" in got and "uid" in got, got
    assert named in got


def test_find_latest_valid_never_skips_an_unreadable_newest_checkpoint(shared_tmp: Path) -> None:
    save_tensors(shared_tmp / "ck", "a", {"w": torch.ones(4)}, {"counters": {"global_steps": 1}})
    save_tensors(shared_tmp / "ck", "b", {"w": torch.ones(4)}, {"counters": {"global_steps": 2}})
    readable_tree(shared_tmp)
    os.chmod(shared_tmp / "ck" / "b", 0)
    got = as_other_user(lambda: f"returned {find_latest_valid(str(shared_tmp / 'ck'))}")
    assert got.startswith(f"raw {CheckpointPathError.__name__}") and str(shared_tmp / "ck" / "b") in got, got


def test_the_permission_error_is_injected_the_same_without_privileges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same refusal when the OS's PermissionError is injected into the open of the manifest
    (the path every read of a checkpoint folder goes through)."""
    import errno

    import tiered.checkpoint.paths as paths

    tag = _checkpoint(tmp_path)
    real_open = os.open

    def denied(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith("manifest.json"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(paths.os, "open", denied)
    with pytest.raises(CheckpointPathError, match="permission denied for user"):
        read_parameters(str(tmp_path / "ck"))
    assert tag.is_dir()
