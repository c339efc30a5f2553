"""A checkpoint folder edited, redirected or raced by a careless user or an attacker: every case
ends as a clear error (or waits its turn) before anything is lost. See [Note: manifest checksum],
[Note: checkpoint tags], [Note: checkpoint save lock], [Note: reclaiming interrupted saves] and
[Note: nothing foreign in a checkpoint folder]."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered.checkpoint import load_tensors, read_latest, save_tensors
from tiered.checkpoint.lock import LOCK_FILE, SaveLock
from tiered.errors import CheckpointCorruptError, CheckpointLockError, CheckpointPathError
from tiered.finetune.checkpointing import CheckpointPolicy

ROOT = Path(__file__).resolve().parent.parent


def _t(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, generator=g), "b": torch.randn(7, generator=g)}


def _edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))


def _returns_unblocked(fn: Callable[[], Any], fifo: Path) -> tuple[bool, BaseException | None]:
    """(blocked, error) of `fn()` run in a thread: if it is still running after 15 s it is
    blocked (on opening `fifo`), which is then unblocked by opening its write end."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(15)
    blocked = t.is_alive()
    if blocked:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        t.join(15)
    return blocked, (err[0] if err else None)


# ---- the manifest --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(counters={"global_steps": 7}),
        lambda m: m["files"]["tensors.safetensors"].update(xxh3_64="0" * 16),
        lambda m: m.update(created_unix_s=m["created_unix_s"] + 1),
    ],
    ids=["counter-added", "file-checksum-replaced", "timestamp-moved"],
)
def test_an_edited_manifest_is_refused_naming_the_file(tmp_path: Path, edit: Callable[..., None]) -> None:
    path = Path(save_tensors(tmp_path, "s", _t()))
    _edit_manifest(path, lambda m: None)  # re-serialised, other whitespace, same content: loads
    load_tensors(tmp_path)
    _edit_manifest(path, edit)
    with pytest.raises(CheckpointCorruptError, match="fails its checksum") as ei:
        load_tensors(tmp_path)
    assert str(path / "manifest.json") in str(ei.value) and "edited" in str(ei.value)


def test_an_edited_engine_manifest_is_refused_instead_of_loading_shifted_weights(tmp_path: Path) -> None:
    from engine_support import CASES, build, ds_config

    import tiered

    model = build(CASES["mlp"])
    with tiered.initialize(model, ds_config(param="cpu", opt="cpu")) as e:
        path = Path(e.save_checkpoint(tmp_path / "ck"))
        piece = next(iter(json.loads((path / "manifest.json").read_text())["parameters"]))

        def shift(m: dict[str, Any]) -> None:
            m["parameters"][piece]["pieces"][0]["start_in_shard"] += 1

        _edit_manifest(path, shift)
        with pytest.raises(CheckpointCorruptError, match=r"manifest\.json fails its checksum"):
            e.load_checkpoint(tmp_path / "ck")


# ---- latest and tags -------------------------------------------------------------------------
@pytest.mark.parametrize("pointer", ["ABS", "../other/s", "s/../../other/s", "s\x00x"])
def test_latest_may_only_name_a_tag_beside_it(tmp_path: Path, pointer: str) -> None:
    save_tensors(tmp_path / "ck", "s", _t(0))
    save_tensors(tmp_path / "other", "s", _t(1))  # what the pointer would load instead
    if pointer == "ABS":
        pointer = str(tmp_path / "other" / "s")
    (tmp_path / "ck" / "latest").write_text(pointer)
    with pytest.raises(
        CheckpointCorruptError, match="latest may only name a checkpoint folder beside it"
    ) as ei:
        load_tensors(tmp_path / "ck")
    assert str(tmp_path / "ck" / "latest") in str(ei.value)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_latest_that_is_not_a_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    save_tensors(tmp_path / "ck", "s", _t(0), manifest={})
    latest = tmp_path / "ck" / "latest"
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)
    else:
        (tmp_path / "elsewhere").write_text("s")
        latest.symlink_to(tmp_path / "elsewhere")
    blocked, err = _returns_unblocked(lambda: load_tensors(tmp_path / "ck"), latest)
    assert not blocked, "load blocked opening a FIFO named latest"
    assert isinstance(err, CheckpointCorruptError), err
    assert str(latest) in str(err) and ("FIFO" in str(err) or "symlink" in str(err))


@pytest.mark.parametrize(
    ("tag", "why"),
    [("a\x00b", "NUL"), ("x" * 300, "at most 246 bytes"), (" s", "whitespace"), ("a\nb", "control")],
    ids=["nul", "300-chars", "space", "newline"],
)
def test_a_tag_that_cannot_be_a_folder_name_is_refused_by_name(tmp_path: Path, tag: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"checkpoint tag .*{why}"):
        save_tensors(tmp_path, tag, _t())
    assert not (tmp_path / "latest").exists()


# ---- the save folder -------------------------------------------------------------------------
def test_a_save_folder_that_is_a_file_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "ck").write_text("not a folder")
    with pytest.raises(CheckpointPathError, match="exists and is not a folder") as ei:
        save_tensors(tmp_path / "ck", "s", _t())
    assert str(tmp_path / "ck") in str(ei.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_a_save_folder_that_is_not_writable_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir(mode=0o500)
    with pytest.raises(CheckpointPathError, match="not writable") as ei:
        save_tensors(tmp_path / "ck", "s", _t())
    assert str(tmp_path / "ck") in str(ei.value)


# ---- symlinks in a checkpoint folder ---------------------------------------------------------
def test_resaving_a_tag_whose_folder_is_a_symlink_is_refused_before_writing(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_tensors(ck, "old", _t(0))
    target = tmp_path / "elsewhere"
    save_tensors(tmp_path, "elsewhere", _t(1))
    (ck / "s").symlink_to(target)
    with pytest.raises(CheckpointPathError, match="is a symlink, not a checkpoint directory") as ei:
        save_tensors(ck, "s", _t(2))
    assert str(ck / "s") in str(ei.value)
    assert read_latest(ck) == "old" and (ck / "s").is_symlink()
    assert sorted(p.name for p in ck.iterdir()) == [LOCK_FILE, "latest", "old", "s"]  # no .s.partial left
    assert torch.equal(load_tensors(tmp_path, "elsewhere")[2]["w"], _t(1)["w"])  # the target untouched


def test_a_symlinked_checkpoint_or_rank_file_is_refused_on_load(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_tensors(ck, "real", _t(0))
    (ck / "link").symlink_to(ck / "real")
    with pytest.raises(CheckpointCorruptError, match="is a symlink"):
        load_tensors(ck, "link")
    f = ck / "real" / "tensors.safetensors"
    os.rename(f, tmp_path / "moved.safetensors")
    os.mkfifo(f)
    blocked, err = _returns_unblocked(lambda: load_tensors(ck, "real"), f)
    assert not blocked and isinstance(err, CheckpointCorruptError) and "FIFO" in str(err), err


# ---- interrupted saves -----------------------------------------------------------------------
def test_leftovers_of_interrupted_saves_are_reclaimed_by_the_next_save_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = tmp_path / "ck"
    save_tensors(ck, "a", _t(0))
    save_tensors(ck, "b", _t(1))
    (ck / ".c.partial").mkdir()  # what a kill -9 during the save of "c" leaves
    (ck / ".c.partial" / "tensors.safetensors").write_bytes(b"x" * 1000)
    os.rename(ck / "b", ck / ".b.old")  # a replace of "b" killed between its two renames
    (ck / ".latest.tmp").write_text("c")
    with caplog.at_level(logging.WARNING, logger="tiered.checkpoint"):
        save_tensors(ck, "d", _t(2))
    assert sorted(p.name for p in ck.iterdir()) == [LOCK_FILE, "a", "b", "d", "latest"]
    assert torch.equal(load_tensors(ck, "b")[2]["w"], _t(1)["w"])  # the only copy came back
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "removed .c.partial" in msg and "renamed .b.old back to b" in msg and str(ck) in msg


# ---- the save lock ---------------------------------------------------------------------------
def test_a_second_saver_waits_its_turn_then_fails_naming_the_holder(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_tensors(ck, "a", _t(0))
    holder = SaveLock(str(ck))
    holder.acquire()
    try:
        with pytest.raises(CheckpointLockError, match=f"pid {os.getpid()} host") as ei:
            save_tensors_locked(ck, "b", timeout_s=0.3)
        assert str(ck / LOCK_FILE) in str(ei.value)
        assert read_latest(ck) == "a" and not (ck / "b").exists() and not (ck / ".b.partial").exists()
        threading.Timer(0.3, holder.release).start()
        save_tensors_locked(ck, "b", timeout_s=30)  # waits for the holder, then saves
    finally:
        holder.release()
    assert read_latest(ck) == "b"


def save_tensors_locked(ck: Path, tag: str, timeout_s: float) -> None:
    from tiered.checkpoint.stream import TensorSpec, chunks_of, file_bytes
    from tiered.checkpoint.writer import CheckpointWriter

    t = _t(3)
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in t.items()]
    w = CheckpointWriter(ck, tag, lock_timeout_s=timeout_s)
    w.begin(file_bytes(specs))
    try:
        w.write_file("tensors.safetensors", specs, (c for v in t.values() for c in chunks_of(v, 1 << 20)))
        w.commit({})
    except BaseException:
        w.abort()
        raise


_SAVER = """
import sys, torch
from tiered.checkpoint import save_tensors
ck, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
errors = 0
for i in range(n):
    try:
        save_tensors(ck, "same" if i % 2 else f"t{me}_{i}", {"w": torch.full((1 << 18,), float(me * 100 + i))},
                     manifest={"counters": {"global_steps": i}})
    except Exception as e:
        errors += 1
        print(f"saver {me}: {type(e).__name__}: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
"""


@pytest.mark.slow
def test_concurrent_savers_into_one_folder_all_succeed_and_latest_always_verifies(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    for _ in range(2):  # two rounds: the second starts on the first one's folder
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SAVER, str(ck), str(me), "8"],
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
            for me in range(3)
        ]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(errs)
        path, _, tensors = load_tensors(ck)  # every file of what latest names verifies
        assert Path(path).parent == ck and tensors["w"].numel() == 1 << 18
        assert not [p.name for p in ck.iterdir() if p.name.endswith((".partial", ".old", ".tmp"))]


# ---- pruning ---------------------------------------------------------------------------------
def _run_folder(tmp_path: Path, steps: list[int]) -> CheckpointPolicy:
    policy = CheckpointPolicy(out_dir=tmp_path / "run", keep_last=2)
    for s in steps:
        save_tensors(
            policy.checkpoints_dir, f"global_step{s}", _t(s), manifest={"training": {"global_steps": s}}
        )
    return policy


def test_pruning_skips_foreign_symlinks_and_keeps_the_newest_it_wrote(tmp_path: Path) -> None:
    policy = _run_folder(tmp_path, [1, 2, 3])
    root = policy.checkpoints_dir
    foreign = tmp_path / "foreign"
    for s in (0, 99):  # someone else's checkpoints, linked in: one "newer", one "older" than ours
        save_tensors(foreign, f"global_step{s}", _t(s), manifest={"training": {"global_steps": s}})
        (root / f"global_step{s}").symlink_to(foreign / f"global_step{s}")
    deleted = policy.prune(2)
    assert deleted == [str(root / "global_step1")]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "global_step0",
        "global_step2",
        "global_step3",
        "global_step99",
        "latest",
    ]
    assert (foreign / "global_step0" / "manifest.json").is_file()  # nothing followed
    assert (foreign / "global_step99" / "manifest.json").is_file()


def test_pruning_deletes_nothing_while_a_kept_checkpoint_does_not_verify(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = _run_folder(tmp_path, [1, 2, 3])
    root = policy.checkpoints_dir
    with open(root / "global_step2" / "tensors.safetensors", "r+b") as f:
        f.truncate(100)  # the second newest, kept in place of global_step1, is damaged
    with caplog.at_level(logging.WARNING):
        assert policy.prune(2) == []
    assert (root / "global_step1").is_dir()
    assert any("does not verify" in r.getMessage() for r in caplog.records)


# ---- a closed engine -------------------------------------------------------------------------
def test_every_call_on_a_closed_engine_says_the_engine_is_closed(tmp_path: Path) -> None:
    from engine_support import CASES, build, ds_config

    import tiered

    e = tiered.initialize(build(CASES["mlp"]), ds_config(param="cpu", opt="cpu"))
    e.save_checkpoint(tmp_path / "ck")
    e.close()
    for call in (
        lambda: e.state_dict_fp32(),
        lambda: e.save_checkpoint(tmp_path / "ck"),
        lambda: e.load_checkpoint(tmp_path / "ck"),
        lambda: e.save_pretrained(tmp_path / "hf"),
    ):
        with pytest.raises(RuntimeError, match="this tiered Engine is closed; create a new one"):
            call()
