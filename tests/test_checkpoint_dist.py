"""The world size may change: a checkpoint saved by 2 gloo ranks loads on 1 rank and the reverse,
resharded on load, with every parameter's state bitwise what was saved."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from checkpoint_support import train
from engine_support import CASES, assert_params_close, build, ds_config, make_batches
from test_equivalence_dist import _free_port, _halve

import tiered
from tiered.checkpoint import read_manifest, read_parameters

N, M = 2, 2
KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


def _config(tmp: str, sub: str) -> dict[str, Any]:
    return ds_config(param="cpu", opt="nvme", nvme_path=os.path.join(tmp, sub), gas=2, sub_group_size=700)


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        case = CASES["mlp"]
        batches = [_halve(b, rank, world) for b in make_batches(case, N + M, 8, gas=2)]
        with tiered.initialize(build(case), _config(tmp, "nvme2")) as e:
            train(e, case, batches[: 2 * N])
            e.save_checkpoint(os.path.join(tmp, "two"))
            train(e, case, batches[2 * N :])
            final = e.state_dict_fp32()
        with tiered.initialize(build(case, seed=99), _config(tmp, "nvme2")) as e:
            e.load_checkpoint(os.path.join(tmp, "one"))
            e.save_checkpoint(os.path.join(tmp, "one_resaved_by_two"))
            train(e, case, batches[2 * N :])
            from_one = e.state_dict_fp32()
        if rank == 0:
            torch.save({"final": final, "from_one": from_one}, os.path.join(tmp, "two_ranks.pt"))
    finally:
        dist.destroy_process_group()


def _assert_same_checkpoint_state(a: Path, b: Path) -> None:
    for kind in KINDS:
        x, y = read_parameters(a, kind=kind), read_parameters(b, kind=kind)
        assert set(x) == set(y)
        for k in x:
            assert torch.equal(x[k], y[k]), f"{kind} of {k} changed when resharded"


def test_checkpoints_reshard_between_two_ranks_and_one(tmp_path: Path) -> None:
    case = CASES["mlp"]
    batches = make_batches(case, N + M, 8, gas=2)
    with tiered.initialize(build(case), _config(str(tmp_path), "nvme1")) as e:
        train(e, case, batches[: 2 * N])
        e.save_checkpoint(tmp_path / "one")
    mp.start_processes(
        _worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=True
    )
    two_ranks = torch.load(tmp_path / "two_ranks.pt")
    with tiered.initialize(build(case, seed=99), _config(str(tmp_path), "nvme1")) as e:
        e.load_checkpoint(tmp_path / "two")
        e.save_checkpoint(tmp_path / "two_resaved_by_one")
        train(e, case, batches[2 * N :])
        from_two = e.state_dict_fp32()
    with tiered.initialize(build(case, seed=99), _config(str(tmp_path), "nvme1")) as e:
        e.load_checkpoint(tmp_path / "one")
        train(e, case, batches[2 * N :])
        one_continued = e.state_dict_fp32()
    saved = read_manifest(str(tmp_path / "two" / f"global_step{N}"))
    assert saved["world_size"] == 2
    assert any({p["rank"] for p in info["pieces"]} == {0, 1} for info in saved["parameters"].values())
    # resharding moves bytes only: every parameter's state is bitwise what was saved
    _assert_same_checkpoint_state(tmp_path / "two", tmp_path / "two_resaved_by_one")
    _assert_same_checkpoint_state(tmp_path / "one", tmp_path / "one_resaved_by_two")
    # and training on from either continues as the other world size would (the 2-vs-1 bound)
    assert_params_close(from_two, two_ranks["final"], 1e-5)
    assert_params_close(two_ranks["from_one"], one_continued, 1e-5)
