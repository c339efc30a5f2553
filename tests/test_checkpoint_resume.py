"""Bit-exact resume: N steps, save, a new engine (or a new process), load, M steps equals N + M
steps uninterrupted, bit for bit (parameters, fp32 masters, Adam moments, counters, losses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_support import assert_bitwise_equal, full_state, train
from engine_support import CASES, build, ds_config, make_batches

import tiered

HERE = Path(__file__).parent
DEVICES = {"gpu": "none", "cpu": "cpu", "nvme": "nvme"}
SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 8},
}


def _resume_equals_uninterrupted(
    tmp_path: Path,
    case_name: str,
    config: dict[str, Any],
    *,
    n: int,
    m: int,
    gas: int = 1,
    device: str = "cpu",
) -> dict[str, Any]:
    case = CASES[case_name]
    batches = [{k: v.to(device) for k, v in b.items()} for b in make_batches(case, n + m, 4, gas=gas)]
    with tiered.initialize(build(case), config) as e:
        want_losses = train(e, case, batches)
        want = full_state(e)
    with tiered.initialize(build(case), config) as e:
        first = train(e, case, batches[: n * gas])
        path = e.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 1, "data_position": n * gas})
        assert os.path.basename(path) == f"global_step{n}"
    # a different initialisation: everything must come from the checkpoint
    with tiered.initialize(build(case, seed=99), config) as e:
        got_path, client = e.load_checkpoint(tmp_path / "ckpt")
        assert got_path == path and client == {"epoch": 1, "data_position": n * gas}
        rest = train(e, case, batches[n * gas :])
        got = full_state(e)
    assert first + rest == want_losses
    assert_bitwise_equal(got, want)
    return want


@pytest.mark.parametrize("opt", ["gpu", "cpu", "nvme"])
@pytest.mark.parametrize("param", ["gpu", "cpu", "nvme"])
def test_resume_is_bit_exact_in_every_placement(tmp_path: Path, param: str, opt: str) -> None:
    config = ds_config(
        param=DEVICES[param],
        opt=DEVICES[opt],
        nvme_path=str(tmp_path / "nvme"),
        gas=2,
        scheduler=SCHEDULER,
        sub_group_size=1000,
    )
    want = _resume_equals_uninterrupted(tmp_path, "mlp", config, n=2, m=2, gas=2)
    assert len({k.split(".")[0] for k in want["opt"]}) > 1  # several groups: the layout is exercised


def test_resume_is_bit_exact_in_bf16_with_clipping(tmp_path: Path) -> None:
    config = ds_config(
        param="nvme", opt="cpu", nvme_path=str(tmp_path / "nvme"), dtype="bf16", clip=0.5, scheduler=SCHEDULER
    )
    _resume_equals_uninterrupted(tmp_path, "llama", config, n=2, m=2)


def test_resume_is_bit_exact_with_fp16_loss_scaling(tmp_path: Path) -> None:
    # a scale of 2**30 overflows at first: the run skips steps and lowers the scale, so the
    # checkpoint must carry the scaler's state (scale, hysteresis, iteration) and skipped_steps
    config = ds_config(
        param="cpu",
        opt="nvme",
        nvme_path=str(tmp_path / "nvme"),
        dtype="fp16",
        fp16={"initial_scale_power": 30, "loss_scale_window": 2, "hysteresis": 2},
    )
    want = _resume_equals_uninterrupted(tmp_path, "llama", config, n=3, m=3)
    assert want["counters"][2] > 0, "no step was skipped: the test does not exercise the loss scaler"


def test_resume_is_bit_exact_with_the_step_overlapped_with_backward(tmp_path: Path) -> None:
    config = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), gas=2, sub_group_size=1000)
    config["tiered"] = {**config.get("tiered", {}), "overlap_step_with_backward": True}
    _resume_equals_uninterrupted(tmp_path, "mlp", config, n=2, m=2, gas=2)


_CHILD = r"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
from checkpoint_support import full_state, train
from engine_support import CASES, build, make_batches
import tiered
case = CASES["llama"]
config = json.loads({config!r})
batches = make_batches(case, 4, 4)
with tiered.initialize(build(case, seed=7), config) as e:
    e.load_checkpoint({ckpt!r})
    losses = train(e, case, batches[2:])
    st = full_state(e)
torch.save({{"losses": losses, "params": st["params"], "opt": st["opt"], "counters": st["counters"]}}, {out!r})
"""


def test_resume_in_a_new_process_is_bit_exact(tmp_path: Path) -> None:
    case = CASES["llama"]
    config = ds_config(
        param="cpu", opt="nvme", nvme_path=str(tmp_path / "nvme"), dtype="bf16", scheduler=SCHEDULER
    )
    batches = make_batches(case, 4, 4)
    with tiered.initialize(build(case), config) as e:
        want_losses = train(e, case, batches)
        want = full_state(e)
    with tiered.initialize(build(case), config) as e:
        first = train(e, case, batches[:2])
        e.save_checkpoint(tmp_path / "ckpt")
    code = _CHILD.format(
        tests=str(HERE),
        config=json.dumps(config),
        ckpt=str(tmp_path / "ckpt"),
        out=str(tmp_path / "child.pt"),
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(HERE.parent), str(HERE.parent / "plugins"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600)
    got = torch.load(tmp_path / "child.pt")
    assert first + got["losses"] == want_losses
    assert got["counters"] == want["counters"]
    for section in ("params", "opt"):
        for k, v in want[section].items():
            assert torch.equal(got[section][k], v), f"{section} {k} differs after a resume in a new process"


def test_a_checkpoint_loads_into_another_placement_and_sub_group_size(tmp_path: Path) -> None:
    """Saved with a separate fp32 master (parameters in "gpu", state in "cpu"), loaded where the
    parameter partition is the master (both on nvme) with other group boundaries: saving again
    from the new engine gives every parameter's state bit for bit."""
    from tiered.checkpoint import read_parameters

    case = CASES["mlp"]
    first = ds_config(param="none", opt="cpu", sub_group_size=1000)
    second = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), sub_group_size=5000)
    with tiered.initialize(build(case), first) as e:
        train(e, case, make_batches(case, 2, 4))
        e.save_checkpoint(tmp_path / "a")
        layout = [g.shard_numel for g in e.zero.groups]
    with tiered.initialize(build(case, seed=3), second) as e:
        assert [g.shard_numel for g in e.zero.groups] != layout
        e.load_checkpoint(tmp_path / "a")
        e.save_checkpoint(tmp_path / "b")
        train(e, case, make_batches(case, 1, 4, seed=9))  # and it trains on
    for kind in ("param", "master", "exp_avg", "exp_avg_sq"):
        a, b = read_parameters(tmp_path / "a", kind=kind), read_parameters(tmp_path / "b", kind=kind)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), kind


@pytest.mark.parametrize(("param", "opt"), [("gpu", "gpu"), ("nvme", "cpu")])
def test_resume_is_bit_exact_with_idle_experts(tmp_path: Path, param: str, opt: str) -> None:
    # per-parameter step counts (an expert idle on some steps counts fewer) travel with the
    # checkpoint, keyed by parameter name: without them the resumed bias correction differs
    from unused_support import CASES as UNUSED
    from unused_support import make_batches as unused_batches

    case = UNUSED["moe"]
    config = ds_config(param=DEVICES[param], opt=DEVICES[opt], nvme_path=str(tmp_path / "nvme"), lr=1e-2)
    batches = unused_batches("moe", 5, 4)
    with tiered.initialize(build(case), config) as e:
        want_losses = train(e, case, batches)
        want = full_state(e)
    with tiered.initialize(build(case), config) as e:
        first = train(e, case, batches[:3])
        counts = e.optimizer.param_step_counts()
        assert min(counts.values()) < 3 == max(counts.values())  # some expert was idle before the save
        e.save_checkpoint(tmp_path / "ckpt")
    # another sub_group_size too: the counts are keyed by parameter, not by group
    other = {**config, "zero_optimization": {**config["zero_optimization"], "sub_group_size": 500}}
    with tiered.initialize(build(case, seed=99), other) as e:
        e.load_checkpoint(tmp_path / "ckpt")
        assert e.optimizer.param_step_counts() == counts
        rest = train(e, case, batches[3:])
        got = full_state(e)
    assert first + rest == want_losses
    assert_bitwise_equal({**got, "opt": {}}, {**want, "opt": {}})  # (groups may differ: params compared)


@pytest.mark.parametrize("bad", ["3", 2.0, -1, True, None])
def test_a_checkpoint_whose_optimizer_step_is_not_a_non_negative_int_is_refused(
    tmp_path: Path, bad: object
) -> None:
    """The optimizer owns its step count and checks the one it is given: a manifest rewritten
    with a consistent checksum but a step count that is no count is refused by its key, not
    coerced (``int("3")``, ``int(2.0)``, ``int(True)``) into a silently different bias correction."""
    from tiered.checkpoint.directory import MANIFEST_CHECKSUM, manifest_digest
    from tiered.errors import CheckpointCorruptError

    case = CASES["mlp"]
    config = ds_config(param="cpu", opt="cpu")
    with tiered.initialize(build(case), config) as e:
        train(e, case, make_batches(case, 2, 4))
        path = Path(e.save_checkpoint(tmp_path / "ckpt"))
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["training"]["optimizer_step"] = bad
        manifest[MANIFEST_CHECKSUM] = manifest_digest(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointCorruptError, match=r"training\.optimizer_step"):
            e.load_checkpoint(tmp_path / "ckpt")
