"""2 gloo ranks (each half the global batch) == 1 rank on the whole batch, to 1e-5."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from engine_support import CASES, assert_params_close, build, ds_config, make_batches, tiered_train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _halve(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def _worker(rank: int, world: int, port: int, case_name: str, config: dict[str, Any], out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        case = CASES[case_name]
        batches = [
            _halve(b, rank, world)
            for b in make_batches(case, 3, 8, gas=config["gradient_accumulation_steps"])
        ]
        losses, state, stats = tiered_train(build(case), case, batches, config)
        torch.save(
            {
                "losses": losses,
                "state": state,
                "stats_steps": stats["optimizer"]["step_count"],
                "overlapped": stats["optimizer"]["total"]["overlapped_steps"],
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path: Path, case_name: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    mp.start_processes(
        _worker,
        args=(2, _free_port(), case_name, config, str(tmp_path)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize(("param", "opt", "gas", "clip"), [("cpu", "nvme", 1, 0.0), ("nvme", "cpu", 2, 0.05)])
def test_two_gloo_ranks_equal_one_rank(tmp_path: Path, param: str, opt: str, gas: int, clip: float) -> None:
    config = ds_config(param=param, opt=opt, nvme_path=str(tmp_path / "nvme"), gas=gas, clip=clip)
    ranks = run_two_ranks(tmp_path, "mlp", config)
    case = CASES["mlp"]
    one_losses, one, _ = tiered_train(
        build(case),
        case,
        make_batches(case, 3, 8, gas=gas),
        ds_config(param=param, opt=opt, nvme_path=str(tmp_path / "nvme1"), gas=gas, clip=clip),
    )
    for r in ranks:
        assert r["stats_steps"] == 3 and r["overlapped"] == 0
        assert_params_close(r["state"], one, 1e-5)
    # each rank saw half of every global batch: the mean of their losses is the 1-rank loss
    for i, full in enumerate(one_losses):
        mean = (ranks[0]["losses"][i] + ranks[1]["losses"][i]) / 2
        assert mean == pytest.approx(full, rel=1e-5)


def test_two_gloo_ranks_with_the_step_overlapped_with_backward(tmp_path: Path) -> None:
    # each rank steps its shard of a group once the group's reduce-scatter is done, during backward
    config = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), gas=2)
    config["tiered"] = {**config.get("tiered", {}), "overlap_step_with_backward": True}
    ranks = run_two_ranks(tmp_path, "mlp", config)
    assert list((tmp_path / "nvme").iterdir()) == []  # both ranks' swap folders gone, no rank<r> left
    case = CASES["mlp"]
    _, one, _ = tiered_train(
        build(case),
        case,
        make_batches(case, 3, 8, gas=2),
        ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme1"), gas=2),
    )
    for r in ranks:
        assert r["stats_steps"] == 3 and r["overlapped"] == 3
        assert_params_close(r["state"], one, 1e-5)
