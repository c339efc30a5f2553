"""Every case of issue 23 (a checkpoint folder edited, redirected or raced; a hostile offload
folder; poisoned training input; bad config and data) and of issue 37's round on the newer
surfaces (model folders, plan and finetune flags, bench JSON, --out, weights files, manifests,
the DeepSpeed surface: tests/reliability_probe_surfaces.py), run against the code as it is now
and classified, the way tests/deepspeed_probe.py runs the DeepSpeed surface.

``python tests/reliability_probe.py [--quick] [--issue 23|37] [--json FILE] [--markdown]
[--only ID,...] [--timeout-scale X]`` runs each case in a worker subprocess with a per-case time
limit (a hang kills the worker and is reported as a hang, class "wrong"; the worker restarts on
the next case) and an address-space limit (a case that reads without end meets MemoryError, not
the OOM killer), and prints one line per case and the counts per class.
tests/test_reliability_probe.py runs the quick cases and asserts none is "unclear" or "wrong";
docs/reliability.md is the table ``--markdown`` prints.

The classes: "clear" (an error naming what, where and the fix; nothing lost or written where it
should not be), "fine" (works as it should), "unclear" (a raw error), "wrong" (a silent bad
result, a hang, something lost). Each case names its expected class and the check it makes;
"old" is the behaviour issue 23 reported before the fixes (issue 37's: what the code did before
them, measured on a496f13: BEFORE_37).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from probe_support import (
    _WORKDIR,
    CASES,
    CLASSES,
    HERE,
    MARK,
    ROOT,
    WORKER_MEMORY_BYTES,
    Case,
    Outcome,
    Warnings,
    _env,
    _short,
    also,
    as_nobody,
    case,
    error_class,
    raises,
)


def _tensors(seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, generator=g), "b": torch.randn(7, generator=g)}


def _engine(**kw: Any) -> Any:
    from engine_support import CASES as MODELS
    from engine_support import build, ds_config

    import tiered

    return tiered.initialize(build(MODELS["mlp"]), ds_config(param="cpu", opt="cpu", **kw))


def _batch(n: int = 4) -> dict[str, Any]:
    from engine_support import CASES as MODELS
    from engine_support import make_batches

    return make_batches(MODELS["mlp"], 1, n)[0]


# ---- checkpoints: the manifest ---------------------------------------------------------------
def _edited_engine_manifest(wd: Path, edit: Callable[[dict[str, Any]], bool]) -> Outcome:
    import torch

    CheckpointCorruptError = error_class("CheckpointCorruptError")

    with _engine() as e:
        e.backward(e(**_batch()))
        e.step()
        path = Path(e.save_checkpoint(wd / "ck"))
        before = {k: v.clone() for k, v in e.state_dict_fp32().items()}
        steps = e.global_steps
        m = json.loads((path / "manifest.json").read_text())
        if not edit(m):
            return "unclear", "the probe found nothing to edit in the manifest"
        (path / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
        out = raises(
            lambda: e.load_checkpoint(wd / "ck"), CheckpointCorruptError, "manifest.json fails its checksum"
        )
        after = e.state_dict_fp32()
        return also(
            out,
            (all(torch.equal(after[k], v) for k, v in before.items()), "the weights changed"),
            (e.global_steps == steps, "the step counter changed"),
        )


@case(
    "manifest-start-in-shard",
    "checkpoints",
    "start_in_shard moved by one loaded a bias shifted (0.18 off), silently",
    "clear",
    "load raises CheckpointCorruptError 'manifest.json fails its checksum'; weights and step unchanged",
)
def _manifest_shift(wd: Path) -> Outcome:
    def shift(m: dict[str, Any]) -> bool:
        piece = next(iter(m["parameters"]))
        m["parameters"][piece]["pieces"][0]["start_in_shard"] += 1
        return True

    return _edited_engine_manifest(wd, shift)


@case(
    "manifest-exp-avg-swapped",
    "checkpoints",
    "exp_avg pointed at exp_avg_sq trained 0.0024 off, silently",
    "clear",
    "every group's exp_avg pointed at its exp_avg_sq tensor in the manifest: CheckpointCorruptError on load",
)
def _manifest_swap(wd: Path) -> Outcome:
    def swap(m: dict[str, Any]) -> bool:
        done = False
        for rank in m.get("ranks", []):
            for group in rank.get("groups", []):
                t = group.get("tensors", {})
                if "exp_avg" in t and "exp_avg_sq" in t:
                    t["exp_avg"] = t["exp_avg_sq"]
                    done = True
        return done

    return _edited_engine_manifest(wd, swap)


@case(
    "manifest-step-counter",
    "checkpoints",
    "the step counter and RNG state changed without a word",
    "clear",
    "training.global_steps + 5 in the manifest: CheckpointCorruptError on load, step unchanged",
)
def _manifest_counter(wd: Path) -> Outcome:
    def bump(m: dict[str, Any]) -> bool:
        m.setdefault("training", {})
        m["training"]["global_steps"] = int(m["training"].get("global_steps", 0)) + 5
        return True

    return _edited_engine_manifest(wd, bump)


@case(
    "manifest-rng-state",
    "checkpoints",
    "the RNG state changed without a word",
    "clear",
    "ranks[0].rng.numpy.pos moved by one in the manifest: CheckpointCorruptError on load",
)
def _manifest_rng(wd: Path) -> Outcome:
    def move(m: dict[str, Any]) -> bool:
        rng = m["ranks"][0].get("rng")
        if not rng:
            return False
        rng["numpy"]["pos"] = (int(rng["numpy"]["pos"]) + 1) % 624
        return True

    return _edited_engine_manifest(wd, move)


# ---- checkpoints: latest ---------------------------------------------------------------------
def _latest_pointing(wd: Path, pointer: str) -> Outcome:
    from tiered.checkpoint import load_tensors, save_tensors

    CheckpointCorruptError = error_class("CheckpointCorruptError")

    save_tensors(wd / "ck", "s", _tensors(0))
    save_tensors(wd / "other", "s", _tensors(1))  # what the pointer would load instead
    (wd / "ck" / "latest").write_text(pointer.replace("ABS", str(wd / "other" / "s")))
    return raises(
        lambda: load_tensors(wd / "ck"),
        CheckpointCorruptError,
        "latest may only name a checkpoint folder beside it",
        str(wd / "ck" / "latest"),
    )


@case(
    "latest-absolute",
    "checkpoints",
    "an absolute path in latest loaded a checkpoint from outside the folder",
    "clear",
    "CheckpointCorruptError 'latest may only name a checkpoint folder beside it', naming latest",
)
def _latest_abs(wd: Path) -> Outcome:
    return _latest_pointing(wd, "ABS")


@case(
    "latest-dotdot",
    "checkpoints",
    "'../other/s' in latest loaded a checkpoint from outside the folder",
    "clear",
    "CheckpointCorruptError 'latest may only name a checkpoint folder beside it', naming latest",
)
def _latest_dotdot(wd: Path) -> Outcome:
    return _latest_pointing(wd, "../other/s")


@case(
    "latest-fifo",
    "checkpoints",
    "a FIFO named latest hung load_checkpoint",
    "clear",
    "CheckpointCorruptError naming latest and 'FIFO', within the case's time limit (a hang is 'wrong')",
    timeout_s=30,
)
def _latest_fifo(wd: Path) -> Outcome:
    from tiered.checkpoint import load_tensors, save_tensors

    CheckpointCorruptError = error_class("CheckpointCorruptError")

    save_tensors(wd / "ck", "s", _tensors(0))
    latest = wd / "ck" / "latest"
    latest.unlink()
    os.mkfifo(latest)
    return raises(lambda: load_tensors(wd / "ck"), CheckpointCorruptError, str(latest), "FIFO")


_SAVER = """
import sys, torch
from tiered.checkpoint import save_tensors
ck, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
errors = 0
for i in range(n):
    try:
        save_tensors(ck, "same", {"w": torch.full((1 << 18,), float(me * 100 + i))},
                     manifest={"counters": {"global_steps": i}})
    except Exception as e:
        errors += 1
        print(f"saver {me}: {type(e).__name__}: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
"""


@case(
    "two-savers-one-tag",
    "checkpoints",
    "10-11 of 15 saves failed with raw FileNotFoundError / JSONDecodeError / ENOTEMPTY; in 1 of 4 "
    "runs the tag latest named failed its checksum",
    "fine",
    "three processes save tag 'same' 8 times each at once: all exit 0, latest loads and verifies, "
    "no .partial / .old / .tmp left",
    slow=True,
    timeout_s=150,
)
def _two_savers(wd: Path) -> Outcome:
    from tiered.checkpoint import load_tensors

    ck = wd / "ck"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(ck), str(me), "8"],
            env=_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(3)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    if any(p.returncode for p in procs):
        return "wrong", "a saver failed: " + _short(" ".join(errs))
    try:
        path, _, t = load_tensors(ck)
    except Exception as e:  # noqa: BLE001
        return "wrong", f"latest does not load: {type(e).__name__}: {_short(str(e))}"
    left = [p.name for p in ck.iterdir() if p.name.endswith((".partial", ".old", ".tmp"))]
    return also(
        ("fine", f"24 saves of one tag by 3 processes all succeeded; latest = {Path(path).name} verifies"),
        (not left, f"left behind {left}"),
        (t["w"].numel() == 1 << 18, "the loaded tensor has the wrong size"),
    )


@case(
    "symlinked-tag-resaved",
    "checkpoints",
    "re-saving a tag whose folder is a symlink raised shutil's 'Cannot call rmtree on a symbolic link' "
    "after the swap; latest not moved; a .partial symlink left",
    "clear",
    "CheckpointPathError 'is a symlink, not a checkpoint directory' before writing; latest unchanged; "
    "no .partial; the link's target intact",
)
def _symlinked_tag(wd: Path) -> Outcome:
    import torch

    from tiered.checkpoint import load_tensors, read_latest, save_tensors

    CheckpointPathError = error_class("CheckpointPathError")

    ck = wd / "ck"
    save_tensors(ck, "old", _tensors(0))
    save_tensors(wd, "elsewhere", _tensors(1))
    (ck / "s").symlink_to(wd / "elsewhere")
    out = raises(
        lambda: save_tensors(ck, "s", _tensors(2)),
        CheckpointPathError,
        "is a symlink, not a checkpoint directory",
        str(ck / "s"),
    )
    return also(
        out,
        (read_latest(ck) == "old", "latest moved"),
        (not [p for p in ck.iterdir() if p.name.endswith(".partial")], "a .partial was left"),
        (torch.equal(load_tensors(wd, "elsewhere")[2]["w"], _tensors(1)["w"]), "the target changed"),
    )


@case(
    "keep-last-1-foreign-symlink",
    "checkpoints",
    "--keep-last 1 with a foreign symlink in checkpoints/ died at the next prune after deleting the "
    "two newest good checkpoints; no export",
    "fine",
    "CheckpointPolicy(keep_last=1).prune(1) over global_step1..3 plus linked-in foreign "
    "global_step0 and global_step99: deletes only global_step1, global_step2; keeps global_step3 "
    "and both links; their targets intact and verifying",
)
def _keep_last(wd: Path) -> Outcome:
    from tiered.checkpoint import load_tensors, save_tensors
    from tiered.finetune.checkpointing import CheckpointPolicy

    policy = CheckpointPolicy(out_dir=wd / "run", keep_last=1)
    root = policy.checkpoints_dir
    for s in (1, 2, 3):
        save_tensors(root, f"global_step{s}", _tensors(s), manifest={"training": {"global_steps": s}})
    for s in (0, 99):  # someone else's checkpoints linked in: one "older", one "newer" than ours
        save_tensors(
            wd / "foreign", f"global_step{s}", _tensors(s), manifest={"training": {"global_steps": s}}
        )
        (root / f"global_step{s}").symlink_to(wd / "foreign" / f"global_step{s}")
    try:
        deleted = policy.prune(1)
    except Exception as e:  # noqa: BLE001
        gone = [f"global_step{s}" for s in (1, 2, 3) if not (root / f"global_step{s}").exists()]
        cls = "wrong" if gone else "unclear"
        return cls, f"prune raised {type(e).__name__}: {_short(str(e))}" + (
            f" after deleting {gone}" if gone else ""
        )
    names = sorted(Path(d).name for d in deleted)
    ok_left = (root / "global_step3").is_dir() and all(
        (root / f"global_step{s}").is_symlink() for s in (0, 99)
    )
    try:
        load_tensors(root, "global_step3")
        load_tensors(wd / "foreign", "global_step0")
        load_tensors(wd / "foreign", "global_step99")
        verified = True
    except Exception:  # noqa: BLE001
        verified = False
    return also(
        ("fine", f"pruned {names}; kept global_step3 and both foreign links"),
        (names == ["global_step1", "global_step2"], f"deleted {names}"),
        (ok_left, "the newest or a foreign link is gone"),
        (verified, "a kept checkpoint no longer verifies"),
    )


@case(
    "partial-folders-after-kill-9",
    "checkpoints",
    "partial folders from a kill -9 during save stayed until that tag was saved again",
    "fine",
    "a saver killed (SIGKILL) mid-save, then one save: every .partial/.old/.tmp is gone, with a "
    "WARNING naming the folder; latest verifies",
    slow=True,
    timeout_s=120,
)
def _kill_9(wd: Path) -> Outcome:
    from tiered.checkpoint import load_tensors, save_tensors

    ck = wd / "ck"
    found_partial = False
    for _ in range(5):  # until a kill lands inside a save
        p = subprocess.Popen(
            [sys.executable, str(HERE / "checkpoint_kill_worker.py"), str(ck), "1"],
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        p.stdout.readline()  # one save done
        time.sleep(0.05)
        p.kill()
        p.wait()
        if [q for q in ck.iterdir() if q.name.startswith(".") and q.name != ".lock" and "lock" not in q.name]:
            found_partial = True
            break
    if not found_partial:
        # no kill landed mid-save: leave what such a kill leaves, by hand
        (ck / ".c.partial").mkdir()
        (ck / ".c.partial" / "tensors.safetensors").write_bytes(b"x" * 1000)
    with Warnings() as w:
        save_tensors(ck, "after", _tensors(5))
    left = [q.name for q in ck.iterdir() if q.name.endswith((".partial", ".old", ".tmp"))]
    load_tensors(ck)
    how = "a real kill mid-save" if found_partial else "a staged leftover (no kill landed mid-save)"
    return also(
        ("fine", f"{how}: the next save reclaimed it with a WARNING; latest verifies"),
        (not left, f"left behind {left}"),
        (w.has(str(ck)), "no WARNING named the folder"),
    )


# ---- offload folders and the native build ----------------------------------------------------
@case(
    "fifo-lock-in-stale-swap-folder",
    "offload",
    "a FIFO named lock in a stale tiered-swap-* folder hung tiered.initialize",
    "fine",
    "initialize on that nvme_path and one step return; the FIFO is left alone with a WARNING naming it",
    timeout_s=60,
)
def _fifo_lock(wd: Path) -> Outcome:
    from engine_support import CASES as MODELS
    from engine_support import build, ds_config
    from tiered_nvme.swap import LOCK_NAME, SWAP_PREFIX, host_tag

    import tiered

    nvme = wd / "nvme"
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    trap = nvme / f"{SWAP_PREFIX}{host_tag()}-{pid_max + 1}-ab12_cd"
    trap.mkdir(parents=True)
    os.mkfifo(trap / LOCK_NAME)
    with Warnings() as w:
        with tiered.initialize(
            build(MODELS["mlp"]), ds_config(param="nvme", opt="nvme", nvme_path=str(nvme))
        ) as e:
            e.backward(e(**_batch()))
            e.step()
    return also(
        ("fine", "initialize and a step returned; the FIFO was left alone with a WARNING"),
        ((trap / LOCK_NAME).exists(), "the FIFO was removed"),
        (w.has(str(trap / LOCK_NAME)), "no WARNING named it"),
    )


_STALE = textwrap.dedent(
    """
    import tiered_ext
    from tiered_ext import _loader
    where = _loader.cpu_build()[1]
    where.mkdir(parents=True)
    (where / "lock").write_text("")  # torch's lock, left by a build that was killed
    print(tiered_ext.kernel_info()["cpu_adam"])
    print("lock left:", (where / "lock").exists())
    """
)


@case(
    "stale-kernel-build-lock",
    "offload",
    "a run killed during the first native-kernel build left torch's build lock; every later run "
    "hung silently at its first step",
    "fine",
    "a fresh cache folder holding torch's 'lock' and no holder (compiler /bin/false so nothing "
    "compiles): the kernel load returns, WARNING 'removing the stale build lock', the lock is gone",
    timeout_s=120,
)
def _stale_kernel_lock(wd: Path) -> Outcome:
    from tiered_ext import _cache

    env = _env()
    env.update(CXX="/bin/false", **{_cache.CACHE_ENV: str(wd)})
    p = subprocess.run([sys.executable, "-c", _STALE], env=env, capture_output=True, text=True, timeout=100)
    if p.returncode:
        return "unclear", "exit " + str(p.returncode) + ": " + _short(p.stderr[-400:])
    return also(
        ("fine", "the load returned; the stale lock was removed with a WARNING"),
        ("removing the stale build lock" in p.stderr, "no WARNING"),
        ("lock left: False" in p.stdout, "the lock is still there"),
    )


def _faults_engine(wd: Path, fault: dict[str, Any], timeout_s: float) -> tuple[Any, dict[str, Any]]:
    """(model, config): the tiny MLP with params and optimizer state on a 'faults' tier 'flaky'
    (over an nvme folder) that injects `fault`, under tiered.timeout_s `timeout_s`."""
    from engine_support import CASES as MODELS
    from engine_support import build, faults_tier_config

    return build(MODELS["mlp"]), faults_tier_config(wd, fault, timeout_s)


@case(
    "hung-backend-timeout",
    "offload",
    "a hung backend with timeout_s 20 errored after 63.7 s without naming the backend",
    "clear",
    "the faults backend hangs the first param read after set-up (a fetch) under timeout_s 2: "
    "TierTimeoutError within 2.2 s + 1 s slack, naming 'faults', the tier and tiered.timeout_s",
    timeout_s=60,
)
def _hung_fetch(wd: Path) -> Outcome:
    return _hung_backend(wd, {"kind": "hang", "op": "read", "key": "*.param", "after": 4, "nth": 1})


@case(
    "hung-backend-prefetch",
    "offload",
    "a hung backend with timeout_s 20 errored after 63.7 s without naming the backend",
    "clear",
    "the faults backend hangs the first exp_avg read (a prefetch for the step) under timeout_s 2: "
    "TierTimeoutError within 2.2 s + 1 s slack, naming 'faults', the tier and tiered.timeout_s",
    timeout_s=60,
)
def _hung_prefetch(wd: Path) -> Outcome:
    return _hung_backend(wd, {"kind": "hang", "op": "read", "key": "*.exp_avg", "nth": 1})


def _hung_backend(wd: Path, fault: dict[str, Any]) -> Outcome:
    from engine_support import CASES as MODELS
    from engine_support import make_batches

    import tiered

    t_s = 2.0
    engine = tiered.initialize(*_faults_engine(wd, fault, t_s))
    took = 0.0
    err: BaseException | None = None
    try:
        for b in make_batches(MODELS["mlp"], 3, 4):
            for call in (lambda b=b: engine.backward(engine(**b)), engine.step):
                t0 = time.perf_counter()
                try:
                    call()
                except error_class("TierTimeoutError") as e:
                    err, took = e, time.perf_counter() - t0
                    break
            if err is not None:
                break
    finally:
        try:
            engine.close(restore_weights=False)
        except Exception:  # noqa: BLE001 - the hung backend may fail its close too
            pass
    if err is None:
        return "wrong", "the hang never surfaced"
    msg = str(err)
    missing = [s for s in ("'faults'", "tier 'flaky'", "tiered.timeout_s") if s not in msg]
    if missing:
        return "unclear", f"TierTimeoutError without {missing}: {_short(msg)}"
    return also(
        ("clear", f"TierTimeoutError after {took:.1f} s: {_short(msg)}"),
        (took < 1.1 * t_s + 1.0, f"took {took:.1f} s for timeout_s {t_s}"),
    )


@case(
    "hung-backend-close",
    "offload",
    "the issue asks timeout_s on every wait path, close included: a hung close was cut only at "
    "60 s and logged, never raised",
    "clear",
    "the faults backend hangs its close under timeout_s 2: engine.close() raises TierTimeoutError "
    "within 2.2 s + 1 s slack naming backend 'faults' of tier 'flaky' and tiered.timeout_s; the "
    "other tiers' swap folders removed; the weights given back",
    timeout_s=60,
)
def _hung_close(wd: Path) -> Outcome:
    import tiered

    t_s = 2.0
    engine = tiered.initialize(*_faults_engine(wd, {"kind": "hang", "op": "close"}, t_s))
    engine.backward(engine(**_batch()))
    engine.step()
    t0 = time.perf_counter()
    out = raises(
        engine.close, error_class("TierTimeoutError"), "backend 'faults' of tier 'flaky'", "tiered.timeout_s"
    )
    took = time.perf_counter() - t0
    return also(
        (out[0], f"after {took:.1f} s: {out[1]}"),
        (took < 1.1 * t_s + 1.0, f"took {took:.1f} s for timeout_s {t_s}"),
        (list((wd / "nvme").iterdir()) == [], "the other tiers' swap folders were left"),
        (all(p.numel() > 0 for p in engine.module.parameters()), "the weights were not given back"),
    )


@case(
    "truncated-swap-file",
    "offload",
    "a truncated swap file was retried as transient before failing, with no remedy",
    "clear",
    "a swap file truncated to 0: StorageCorruptError naming the partition, the file, 'ended early' "
    "and 'restore the training state from a checkpoint'; no 'transient error, retry' WARNING",
)
def _truncated_swap(wd: Path) -> Outcome:
    import torch
    from tiered_nvme import NVMeBackend

    StorageCorruptError = error_class("StorageCorruptError")
    from tiered.storage import open_backend
    from tiered.tiers import Tier, TierManager

    nv = NVMeBackend(wd, atomic=False, fsync=False, swap=True)
    with Warnings() as w:
        with TierManager([Tier("cpu", open_backend({"type": "cpu"})), Tier("nvme", nv)], timeout_s=30) as m:
            p = m.create("p", 1 << 20, torch.float32, "nvme", init=torch.ones(1 << 20))
            victim = nv.directory / "p"
            os.truncate(victim, 0)
            out = raises(
                lambda: m.fetch(p, "cpu").result(),
                StorageCorruptError,
                "partition 'p'",
                str(victim),
                "ended early",
                "restore the training state from a checkpoint",
            )
    return also(out, (not w.has("transient error, retry"), "it was retried as transient"))


# ---- training input --------------------------------------------------------------------------
def _nonfinite(where: str, dtype: str) -> Outcome:
    import torch
    import torch.nn.functional as F
    from engine_support import CASES as MODELS
    from engine_support import build, ds_config, make_batches
    from torch import nn

    import tiered

    NonFiniteError = error_class("NonFiniteError")

    class Masked(nn.Module):
        """A finite loss whose gradient is NaN when `x` holds inf where `keep` is False: the
        inf is masked out of the forward, but inf * 0 = NaN reaches `a.weight`'s gradient."""

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor, keep: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return F.mse_loss(self.b(torch.where(keep, h, torch.zeros_like(h))), y)

    td = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(3)
    model: nn.Module
    if where == "grad":
        torch.manual_seed(0)
        model = Masked()
        keep = torch.ones(4, 8, dtype=torch.bool)
        keep[0] = False
        bs = [
            {
                "x": torch.randn(4, 8, generator=g).to(td),
                "keep": keep,
                "y": torch.randn(4, 4, generator=g).to(td),
            }
            for _ in range(2)
        ]
    else:
        model = build(MODELS["mlp"])
        bs = [{k: v.to(td) for k, v in b.items()} for b in make_batches(MODELS["mlp"], 2, 4)]
    bad = {k: v.clone() for k, v in bs[1].items()}
    bad["x"][0, 0] = float("inf") if where == "grad" else float("nan")
    with tiered.initialize(model, ds_config(dtype=dtype, param="cpu", opt="cpu")) as engine:
        engine.backward(engine(**bs[0]))
        engine.step()
        before = {k: v.clone() for k, v in engine.state_dict_fp32().items()}

        def poisoned() -> None:
            engine.backward(engine(**bad))
            engine.step()

        out = raises(poisoned, NonFiniteError, "optimizer step 2", "tiered.nonfinite_step")
        after = engine.state_dict_fp32()
        finite = all(bool(torch.isfinite(v).all()) for v in after.values())
        same = all(torch.equal(after[k], v) for k, v in before.items())
    return also(out, (finite, "a weight is not finite"), (same, "the step reached the weights"))


for _where, _what in (
    ("loss", "NaN in an input (so the loss)"),
    ("grad", "inf in an input masked out of the loss (so a NaN gradient)"),
):
    for _dtype in ("fp32", "bf16"):

        def _make(where: str = _where, dtype: str = _dtype) -> Callable[[Path], Outcome]:
            return lambda wd: _nonfinite(where, dtype)

        case(
            f"nonfinite-{_where}-{_dtype}",
            "training input",
            "NaN or inf in inputs or loss: the step was applied, every parameter became NaN for good, "
            "nothing at WARNING",
            "clear",
            f"{_what}, {_dtype}: NonFiniteError naming 'optimizer step 2' and tiered.nonfinite_step; "
            "the weights stay finite and unchanged",
        )(_make())


@case(
    "empty-batch",
    "training input",
    "an empty batch gave a NaN loss, the step applied, no warning",
    "clear",
    "InputError 'the batch is empty' naming the input; no step counted",
)
def _empty(wd: Path) -> Outcome:
    import torch

    InputError = error_class("InputError")

    with _engine() as e:
        out = raises(
            lambda: e(x=torch.randn(0, 16), y=torch.randn(0, 8)), InputError, "the batch is empty", "'x'"
        )
        return also(out, (e.global_steps == 0 and e.micro_steps == 0, "a step was counted"))


@case(
    "lr-1e30",
    "training input",
    "lr 1e30: NaN loss, exit code 0",
    "clear",
    "optimizer lr 1e30, train 4 steps: NonFiniteError naming tiered.nonfinite_step (tiered "
    "finetune exits 2 on it: tests/test_nonfinite_steps.py); the weights stay finite",
)
def _lr(wd: Path) -> Outcome:
    import torch

    NonFiniteError = error_class("NonFiniteError")

    with _engine(lr=1e30) as e:
        from engine_support import CASES as MODELS
        from engine_support import make_batches

        def train() -> None:
            for b in make_batches(MODELS["mlp"], 4, 4):
                e.backward(e(**b))
                e.step()

        out = raises(train, NonFiniteError, "tiered.nonfinite_step", "is not finite")
        finite = all(bool(torch.isfinite(v).all()) for v in e.state_dict_fp32().values())
    return also(out, (finite, "a weight is not finite"))


@case(
    "backward-on-a-foreign-loss",
    "training input",
    "backward() on a loss the engine did not compute was counted as a step",
    "clear",
    "ValueError 'no parameter the engine trains got a gradient'; micro_steps stays 0",
)
def _foreign_loss(wd: Path) -> Outcome:
    from torch import nn

    with _engine() as e:
        stranger = nn.Linear(16, 1)
        out = raises(
            lambda: e.backward(stranger(_batch()["x"]).sum()),
            ValueError,
            "no parameter the engine trains got a gradient",
        )
        return also(out, (e.micro_steps == 0, "it was counted"))


def _bad_input(x: Any, dtype: str, exc_name: str, *subs: str) -> Outcome:
    import torch

    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    with _engine(dtype=dtype) as e:
        return raises(lambda: e(x=x, y=torch.randn(4, 8, dtype=want)), error_class(exc_name), *subs)


@case(
    "float64-input",
    "training input",
    "float64 inputs gave torch's error (fp16 got the clear InputDtypeError)",
    "clear",
    "a float64 x into an fp32 model: InputDtypeError naming MLP.forward, 'x', both dtypes and .to(torch.float32)",
)
def _f64(wd: Path) -> Outcome:
    import torch

    return _bad_input(
        torch.randn(4, 16, dtype=torch.float64),
        "fp32",
        "InputDtypeError",
        "MLP.forward: input 'x' is torch.float64",
        ".to(torch.float32)",
    )


@case(
    "int64-input",
    "training input",
    "int64 inputs gave torch's error",
    "clear",
    "an int64 x into a bf16 model: InputDtypeError naming 'x' and .to(torch.bfloat16)",
)
def _i64(wd: Path) -> Outcome:
    import torch

    return _bad_input(
        torch.ones(4, 16, dtype=torch.int64),
        "bf16",
        "InputDtypeError",
        "MLP.forward: input 'x' is torch.int64",
        ".to(torch.bfloat16)",
    )


@case(
    "meta-input",
    "training input",
    "meta inputs gave torch's error",
    "clear",
    "InputError 'input 'x' is on the meta device'",
)
def _meta(wd: Path) -> Outcome:
    import torch

    return _bad_input(
        torch.empty(4, 16, device="meta"),
        "fp32",
        "InputError",
        "MLP.forward: input 'x' is on the meta device",
    )


@case(
    "closed-engine",
    "training input",
    "a closed engine reported 'the event loop is closed'",
    "clear",
    "state_dict_fp32 / save_checkpoint / load_checkpoint / save_pretrained after close: each "
    "RuntimeError 'this tiered Engine is closed; create a new one'",
)
def _closed(wd: Path) -> Outcome:
    e = _engine()
    e.save_checkpoint(wd / "ck")
    e.close()
    outs = [
        raises(call, RuntimeError, "this tiered Engine is closed; create a new one")
        for call in (
            lambda: e.state_dict_fp32(),
            lambda: e.save_checkpoint(wd / "ck"),
            lambda: e.load_checkpoint(wd / "ck"),
            lambda: e.save_pretrained(wd / "hf"),
        )
    ]
    bad = [o for o in outs if o[0] != "clear"]
    return bad[0] if bad else outs[0]


@case(
    "module-without-parameters",
    "training input",
    "a module with no parameters was called 'frozen'",
    "clear",
    "ConfigError 'NoParams has no parameters', without 'frozen'",
)
def _no_params(wd: Path) -> Outcome:
    from engine_support import ds_config
    from torch import nn

    import tiered

    ConfigError = error_class("ConfigError")

    class NoParams(nn.Module):
        def forward(self, x: Any) -> Any:
            return x * 2

    out = raises(
        lambda: tiered.initialize(NoParams(), ds_config()), ConfigError, "NoParams has no parameters"
    )
    return ("unclear", out[1] + " (calls it frozen)") if "frozen" in out[1] else out


# ---- config and data -------------------------------------------------------------------------
def _config_error(cfg: Any, exc_name: str, *subs: str) -> Outcome:
    from tiered.config.loader import load_config

    return raises(lambda: load_config(cfg), error_class(exc_name), *subs)


@case(
    "deep-json-data-row",
    "config and data",
    "100k-deep nested JSON in a data row: raw RecursionError",
    "clear",
    "a .jsonl whose line 2 is 100k-deep: ConfigError '<file>:2: JSON nested too deeply'",
)
def _deep_row(wd: Path) -> Outcome:
    ConfigError = error_class("ConfigError")
    from tiered.finetune.data_sources import read_records

    p = wd / "rows.jsonl"
    p.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    return raises(lambda: list(read_records(p)), ConfigError, f"{p}:2: JSON nested too deeply")


@case(
    "deep-json-config",
    "config and data",
    "100k-deep nested JSON in a config: raw RecursionError",
    "clear",
    "a config file 100k levels deep: ConfigError naming the file and 'deeper'",
)
def _deep_config(wd: Path) -> Outcome:
    p = wd / "deep.json"
    p.write_text('{"tiered": {"x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}}")
    return _config_error(str(p), "ConfigError", str(p), "deeper")


@case(
    "aio-block-size-2-40",
    "config and data",
    "aio.block_size 2^40: raw allocation error",
    "clear",
    "ConfigError naming aio.block_size, aio.queue_depth and the 1 GiB bound, at load",
)
def _aio(wd: Path) -> Outcome:
    return _config_error(
        {"aio": {"block_size": 2**40}}, "ConfigError", "aio.block_size", "aio.queue_depth", "1 GiB"
    )


@case(
    "sparse-attention-nested-enabled",
    "config and data",
    "sparse_attention with a nested enabled: true trained silently (docs/config.md says refused)",
    "clear",
    "UnsupportedConfigError 'sparse_attention.layout is enabled' and the fix '\"enabled\": false'",
)
def _sparse(wd: Path) -> Outcome:
    return _config_error(
        {"sparse_attention": {"enabled": False, "layout": {"enabled": True}}},
        "UnsupportedConfigError",
        "sparse_attention.layout is enabled",
        '"enabled": false',
    )


@case(
    "compression-training-nested-enabled",
    "config and data",
    "compression_training with a nested enabled: true trained silently (docs/config.md says refused)",
    "clear",
    "UnsupportedConfigError naming compression_training.weight_quantization.shared_parameters",
)
def _compression(wd: Path) -> Outcome:
    return _config_error(
        {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
        "UnsupportedConfigError",
        "compression_training.weight_quantization.shared_parameters is enabled",
        '"enabled": false',
    )


@case(
    "eps-0",
    "config and data",
    "eps: 0 passed loading and failed at the first step without naming the key",
    "clear",
    "ConfigError at load naming optimizer.params.eps and '> 0'",
)
def _eps(wd: Path) -> Outcome:
    return _config_error(
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 0}}},
        "ConfigError",
        "optimizer.params.eps",
        "> 0",
    )


@case(
    "trace-path-missing-folder",
    "config and data",
    "a trace_path in a missing folder failed after the whole run",
    "clear",
    "ConfigError at initialize: 'tiered.trace_path = ... does not exist'",
)
def _trace(wd: Path) -> Outcome:
    from engine_support import CASES as MODELS
    from engine_support import build, ds_config

    import tiered

    ConfigError = error_class("ConfigError")

    cfg = ds_config()
    cfg["tiered"] = {"trace_path": str(wd / "gone" / "trace.json")}
    return raises(
        lambda: tiered.initialize(build(MODELS["mlp"]), cfg),
        ConfigError,
        "tiered.trace_path",
        "does not exist",
    )


def _bad_tag(wd: Path, tag: str, why: str) -> Outcome:
    from tiered.checkpoint import save_tensors

    out = raises(lambda: save_tensors(wd, tag, _tensors()), ValueError, "checkpoint tag", why)
    return also(out, (not (wd / "latest").exists(), "latest was written"))


@case(
    "tag-nul",
    "config and data",
    "a tag with NUL: raw OSError",
    "clear",
    "ValueError 'checkpoint tag ... NUL'; no latest",
)
def _tag_nul(wd: Path) -> Outcome:
    return _bad_tag(wd, "a\x00b", "NUL")


@case(
    "tag-300-chars",
    "config and data",
    "a tag of 300 characters: raw OSError (name too long)",
    "clear",
    "ValueError 'checkpoint tag ... at most 246 bytes'; no latest",
)
def _tag_long(wd: Path) -> Outcome:
    return _bad_tag(wd, "x" * 300, "at most 246 bytes")


@case(
    "save-folder-is-a-file",
    "config and data",
    "a save folder that is a file: raw OSError",
    "clear",
    "CheckpointPathError naming the path, 'exists and is not a folder'; the file unchanged",
)
def _folder_file(wd: Path) -> Outcome:
    from tiered.checkpoint import save_tensors

    CheckpointPathError = error_class("CheckpointPathError")

    (wd / "ck").write_text("not a folder")
    out = raises(
        lambda: save_tensors(wd / "ck", "s", _tensors()),
        CheckpointPathError,
        "exists and is not a folder",
        str(wd / "ck"),
    )
    return also(out, ((wd / "ck").read_text() == "not a folder", "the file changed"))


@case(
    "save-folder-not-writable",
    "config and data",
    "a save folder that is not writable: raw OSError",
    "clear",
    "a folder mode 0500; as root (chmod does not stop root) the save runs in a forked child that "
    "dropped to uid/gid 65534: CheckpointPathError 'not writable' naming the folder; nothing written",
    timeout_s=60,
)
def _not_writable(wd: Path) -> Outcome:
    from tiered.checkpoint import save_tensors

    CheckpointPathError = error_class("CheckpointPathError")

    os.chmod(wd, 0o755)
    ck = wd / "ck"
    ck.mkdir()
    os.chmod(ck, 0o500)
    t = _tensors()
    out = as_nobody(
        lambda: raises(lambda: save_tensors(ck, "s", t), CheckpointPathError, "not writable", str(ck))
    )
    return also(out, (list(ck.iterdir()) == [], "something was written"))


# ---- issue 37's cases: the newer surfaces -----------------------------------------------------
import reliability_probe_surfaces  # noqa: E402, F401 - registers its cases after issue 23's

# ---- the class issue 23's description gives each case before the fixes ----------------------
# ("unclear": a raw error; "wrong": a silent bad result, a hang, something lost or left behind)
OLD_CLASS: dict[str, str] = {
    **dict.fromkeys(
        [
            "manifest-start-in-shard",
            "manifest-exp-avg-swapped",
            "manifest-step-counter",
            "manifest-rng-state",
            "latest-absolute",
            "latest-dotdot",
            "latest-fifo",
            "two-savers-one-tag",
            "symlinked-tag-resaved",
            "keep-last-1-foreign-symlink",
            "partial-folders-after-kill-9",
            "fifo-lock-in-stale-swap-folder",
            "stale-kernel-build-lock",
            "hung-backend-timeout",
            "hung-backend-prefetch",
            "hung-backend-close",
            "nonfinite-loss-fp32",
            "nonfinite-loss-bf16",
            "nonfinite-grad-fp32",
            "nonfinite-grad-bf16",
            "empty-batch",
            "lr-1e30",
            "backward-on-a-foreign-loss",
            "sparse-attention-nested-enabled",
            "compression-training-nested-enabled",
            "trace-path-missing-folder",
        ],
        "wrong",
    ),
    **dict.fromkeys(
        [
            "truncated-swap-file",
            "float64-input",
            "int64-input",
            "meta-input",
            "closed-engine",
            "module-without-parameters",
            "deep-json-data-row",
            "deep-json-config",
            "aio-block-size-2-40",
            "eps-0",
            "tag-nul",
            "tag-300-chars",
            "save-folder-is-a-file",
            "save-folder-not-writable",
        ],
        "unclear",
    ),
}


# ---- running ---------------------------------------------------------------------------------
def run_one(c: Case, announce: Callable[[Path], None] | None = None) -> dict[str, Any]:
    wd = Path(tempfile.mkdtemp(prefix=f"tiered-probe-{c.id}-"))
    _WORKDIR[:] = [str(wd)]
    if announce:
        announce(wd)
    t0 = time.perf_counter()
    try:
        got, observed = c.fn(wd)
    except Exception as e:  # noqa: BLE001 - a raw error out of the case itself
        got, observed = "unclear", f"raw {type(e).__name__}: {_short(str(e))}"
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    return {"id": c.id, "got": got, "observed": observed, "seconds": round(time.perf_counter() - t0, 2)}


SELFTEST = ("selftest-hang", "selftest-crash")


# ---- the class each issue-37 case had before its fixes: the probe run on a496f13 (--old) -------
BEFORE_37: dict[str, str] = {
    **dict.fromkeys(
        [
            "model-type-number",
            "bandwidth-folder",
            "auto-config-misspelt-key",
            "manifest-files-etc-passwd",
        ],
        "clear",
    ),
    **dict.fromkeys(
        [
            "model-config-linked-like-hf-cache",
            "weights-float64",
            "manifest-v1-when-asked",
            "zero-init-model-after-initialize",
        ],
        "fine",
    ),
    **dict.fromkeys(
        [
            "model-config-nested-100k",
            "model-config-fifo",
            "model-config-dev-zero",
            "model-config-is-a-folder",
            "model-config-1gb",
            "model-heads-0",
            "model-layers-float",
            "model-hidden-string",
            "model-hidden-negative",
            "model-hidden-2-40",
            "model-heads-above-hidden",
            "model-gpt2-n-head-0",
            "model-layers-null",
            "model-rope-theta-string",
            "model-vocab-1e12-all-memory-given",
            "finetune-heads-0",
            "finetune-model-larger-than-the-host",
            "finetune-config-json-fifo",
            "plan-params-1e30",
            "plan-seq-len-0",
            "plan-micro-batch-0",
            "plan-largest-layer-above-model",
            "bandwidth-read-gbps-string",
            "bandwidth-gpu-link-without-rates",
            "bandwidth-nested-100k",
            "bandwidth-1gb",
            "model-tokenizer-json-fifo",
            "config-fifo",
            "config-dev-zero",
            "config-file-1gb",
            "out-checkpoints-is-a-file",
            "out-checkpoints-fifo",
            "manifest-rank-file-etc-passwd",
            "manifest-rank-file-dotdot",
            "manifest-piece-offset-text",
            "manifest-ranks-not-a-list",
            "manifest-piece-unknown-group",
            "checkpoint-manifest-mode-000",
            "checkpoint-tag-folder-mode-000",
            "checkpoint-rank-file-mode-000",
            "checkpoint-latest-mode-000",
            "zero-init-config-42",
            "zero-init-config-list",
            "zero-init-stage-string",
            "gathered-parameters-name",
            "gathered-parameters-int",
            "gathered-parameters-list-of-names",
            "gathered-parameters-modifier-rank-text",
            "zero-init-model-called-before-initialize",
        ],
        "unclear",
    ),
    **dict.fromkeys(
        [
            "model-path-fifo",
            "model-layers-1e9",
            "model-layers-negative",
            "model-vocab-0",
            "model-intermediate-0",
            "model-kv-heads-3-of-4",
            "finetune-layers-1e9",
            "plan-flops-0",
            "plan-flops-nan",
            "plan-seq-len-past-max-positions",
            "bandwidth-dev-zero",
            "bandwidth-fifo",
            "bandwidth-read-gbps-negative",
            "bandwidth-read-gbps-nan",
            "bandwidth-flops-true",
            "bandwidth-flops-0",
            "auto-config-empty",
            "auto-config-key-twice",
            "auto-config-bandwidth-fifo",
            "eval-every-0",
            "data-fifo",
            "data-dev-zero",
            "eval-data-fifo",
            "out-final-is-a-file",
            "out-final-dangling-link",
            "out-held-by-another-process",
            "out-two-runs-at-once",
            "weights-int32-streamed",
            "weights-bool-streamed",
            "weights-int32-compare-torch",
            "weights-int64-python-api",
            "weights-shard-fifo",
            "weights-index-fifo",
            "manifest-downgraded-to-v1",
            "manifest-version-true",
            "checkpoint-newest-unreadable",
            "zero-init-zero-optimization-list",
            "zero-init-config-fifo",
            "zero-init-model-meta-input-before-initialize",
        ],
        "wrong",
    ),
}
BEFORE_37_TREE = "a496f13"


def _worker(ids: list[str]) -> None:
    import resource

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, WORKER_MEMORY_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    sys.path.insert(0, str(HERE))
    by_id = {c.id: c for c in CASES}
    for i in ids:
        if i in SELFTEST:  # the runner's own test: a case that hangs, one that kills its worker
            print(MARK + json.dumps({"start": i, "wd": ""}), flush=True)
            if i == "selftest-hang":
                time.sleep(3600)
            os._exit(9)
        r = run_one(
            by_id[i], lambda wd, i=i: print(MARK + json.dumps({"start": i, "wd": str(wd)}), flush=True)
        )
        print(MARK + json.dumps(r), flush=True)


def run_cases(
    cases: list[Case], log: Callable[[dict[str, Any]], None] | None = None, timeout_scale: float = 1.0
) -> list[dict[str, Any]]:
    """Each case run in a worker subprocess (one worker for as many cases as it gets through); a
    case that passes its time limit (times `timeout_scale`: a loaded machine) kills the worker and
    is a hang."""
    results: dict[str, dict[str, Any]] = {}
    todo = list(cases)
    errlog = tempfile.TemporaryFile("w+")  # the workers' stderr: its end says why one died
    while todo:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(c.id for c in todo)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=errlog,
            text=True,
            cwd=str(ROOT),
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump(p: subprocess.Popen[str] = proc, q: queue.Queue[str | None] = lines) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                q.put(line)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current = todo[0]
        deadline = time.monotonic() + current.timeout_s * timeout_scale
        workdir: str | None = None
        while todo:
            current = todo[0]
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = "TIMEOUT"
            if line is None or line == "TIMEOUT":
                proc.kill()
                proc.wait()
                if workdir:  # what the killed case left (a FIFO, a half-written folder)
                    shutil.rmtree(workdir, ignore_errors=True)
                what = (
                    f"hung: no result within {current.timeout_s * timeout_scale:.0f} s (killed)"
                    if line == "TIMEOUT"
                    else f"the worker died (exit {proc.returncode}): {_tail(errlog)}"
                )
                r = {
                    "id": current.id,
                    "got": "wrong",
                    "observed": what,
                    "seconds": current.timeout_s * timeout_scale,
                }
            elif line.startswith(MARK):
                r = json.loads(line[len(MARK) :])
                if "start" in r:
                    workdir = r["wd"]
                    continue
            else:
                continue
            results[r["id"]] = r
            if log:
                log(r)
            todo.pop(0)
            if todo:
                deadline = time.monotonic() + todo[0].timeout_s * timeout_scale
            if line is None or line == "TIMEOUT":
                break
        else:
            proc.wait()
    out = []
    for c in cases:
        r = results[c.id]
        out.append(
            {
                "id": c.id,
                "group": c.group,
                "old": c.old,
                "old_class": OLD_CLASS.get(c.id) or BEFORE_37.get(c.id, "?"),
                "issue": c.issue,
                "expected": c.expected,
                "check": c.check,
                "slow": c.slow,
                **r,
            }
        )
    errlog.close()
    return out


def _tail(f: Any, n: int = 300) -> str:
    f.seek(0)
    lines = [ln for ln in f.read().splitlines() if ln.strip()]
    f.seek(0, os.SEEK_END)
    return _short(lines[-1] if lines else "(nothing on stderr)", n)


def counts(results: list[dict[str, Any]], key: str = "got") -> dict[str, int]:
    return {k: sum(r[key] == k for r in results) for k in CLASSES}


def markdown(results: list[dict[str, Any]], measured: dict[str, Any] | None = None) -> str:
    """The tables of docs/reliability.md: one section per group, a row per case; with `measured`
    (the --json of a run on an older tree, --old) a column of what that tree did. Issue 37's
    groups have no class from the issue: their "before" is the measured column alone."""
    seen = {r["id"]: r for r in (measured or {}).get("cases", [])}
    out: list[str] = []
    for group in dict.fromkeys(r["group"] for r in results):
        rows = [r for r in results if r["group"] == group]
        newer = rows[0].get("issue", 23) != 23
        if newer:
            head = [
                "case",
                "what the probe does",
                f"before (measured on {(measured or {}).get('tree') or BEFORE_37_TREE})",
            ]
        else:
            head = ["case", "old class: behaviour (issue 23)"]
            head += [f"measured on {measured.get('tree', 'the old tree')}"] if measured else []
        head += ["new behaviour (what the probe saw)", "class"]
        out += [
            f"\n#### {group[0].upper()}{group[1:]}\n",
            "| " + " | ".join(head) + " |",
            "|---" * len(head) + "|",
        ]
        for r in rows:
            slow = " (slow)" if r["slow"] else ""
            m = seen.get(r["id"])
            if newer:
                before = f"{m['got']}: {_short(m['observed'], 160)}" if m else f"{r['old_class']}: {r['old']}"
                cells = [f"`{r['id']}`{slow}", r["check"], before]
            else:
                cells = [f"`{r['id']}`{slow}", f"{r['old_class']}: {r['old']}"]
                if measured:
                    cells.append(f"{m['got']}: {_short(m['observed'], 160)}" if m else "not run")
            cells += [r["observed"], f"**{r['got']}**"]
            out.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(out).lstrip("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--quick", action="store_true", help="skip the slow cases (savers of one tag racing, kill -9)"
    )
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--markdown", action="store_true", help="print the table docs/reliability.md holds")
    ap.add_argument(
        "--old", metavar="FILE", help="with --markdown: the --json of a run on an older tree, as a column"
    )
    ap.add_argument("--tree", help="with --json: the name of the tree run (a commit), kept in the file")
    ap.add_argument("--only", metavar="IDS", help="comma-separated case ids")
    ap.add_argument("--issue", type=int, choices=(23, 37), help="only the cases of this issue")
    ap.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply every case's time limit (a loaded machine, or an old tree whose cases train)",
    )
    ap.add_argument("--list", action="store_true", help="list the cases")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker.split(","))
        return 0
    cases = [c for c in CASES if not (args.quick and c.slow) and args.issue in (None, c.issue)]
    if args.only:
        want = args.only.split(",")
        unknown = sorted(set(want) - {c.id for c in CASES})
        if unknown:
            ap.error(f"unknown case ids {unknown}")
        cases = [c for c in cases if c.id in want]
    if args.list:
        for c in cases:
            print(f"{c.id:40} {c.expected:7} {'slow' if c.slow else ''}")
        return 0
    t0 = time.perf_counter()

    def log(r: dict[str, Any]) -> None:
        print(f"{r['got']:8} {r['id']:40} {r['seconds']:6.1f}s  {r['observed']}", flush=True)

    results = run_cases(cases, log, args.timeout_scale)
    n = counts(results)
    took = time.perf_counter() - t0
    old = counts([r for r in results if r["issue"] == 23], "old_class")
    print(f"\n{len(results)} cases in {took:.0f} s: " + ", ".join(f"{n[k]} {k}" for k in CLASSES))
    for issue in sorted({r["issue"] for r in results}):
        now = counts([r for r in results if r["issue"] == issue])
        print(
            f"issue {issue}'s {sum(now.values())} cases now: " + ", ".join(f"{now[k]} {k}" for k in CLASSES)
        )
    print(
        "issue 23's before its fixes (as the issue reports): " + ", ".join(f"{old[k]} {k}" for k in CLASSES)
    )
    newer = [r for r in results if r["issue"] == 37 and r["id"] in BEFORE_37]
    if newer:
        was = counts(newer, "old_class")
        print(
            f"issue 37's before its fixes (measured on {BEFORE_37_TREE}): "
            + ", ".join(f"{was[k]} {k}" for k in CLASSES)
        )
    off = [r["id"] for r in results if r["got"] != r["expected"]]
    if off:
        print("not as expected: " + ", ".join(off))
    if args.markdown:
        print("\n" + markdown(results, json.loads(Path(args.old).read_text()) if args.old else None))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "tree": args.tree,
                    "counts": n,
                    "old_counts": old,
                    "seconds": round(took, 1),
                    "cases": results,
                },
                indent=1,
            )
        )
    return 1 if any(r["got"] in ("unclear", "wrong") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
