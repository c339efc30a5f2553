"""2 gloo ranks, each half of every batch: a parameter no rank used is stepped on none, equal to
plain torch.optim.AdamW on the whole batch; and "received" is the OR over the ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from engine_support import REL, assert_losses_close, assert_params_close, build, ds_config, reference_train
from unused_support import CASES, make_batches

GAS = {"moe": 1, "branch": 1, "aux": 2}
PLACEMENTS = [(p, o) for p in ("none", "cpu", "nvme") for o in ("none", "cpu", "nvme")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(nvme: str, name: str, param: str, opt: str, overlap: bool) -> dict[str, Any]:
    cfg = ds_config(param=param, opt=opt, nvme_path=nvme, gas=GAS[name], lr=1e-2, weight_decay=0.1)
    if overlap:
        cfg["tiered"] = {**cfg.get("tiered", {}), "overlap_step_with_backward": True}
    return cfg


def _worker(rank: int, world: int, port: int, param: str, opt: str, overlap: bool, out_dir: str) -> None:
    import torch.distributed as dist
    from engine_support import tiered_train

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {}
        for name, case in CASES.items():
            batches = [
                {k: v[rank * 4 : (rank + 1) * 4] for k, v in b.items()}
                for b in make_batches(name, 4, 8, GAS[name], ranks=2)
            ]
            nvme = os.path.join(out_dir, f"nvme-{name}")
            losses, state, _ = tiered_train(
                build(case), case, batches, _config(nvme, name, param, opt, overlap)
            )
            out[name] = {"losses": losses, "state": state}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _check(tmp_path: Path, param: str, opt: str, overlap: bool) -> None:
    mp.start_processes(
        _worker,
        args=(2, _free_port(), param, opt, overlap, str(tmp_path)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, case in CASES.items():
        batches = make_batches(name, 4, 8, GAS[name], ranks=2)
        want_losses, want = reference_train(
            build(case), case, batches, gas=GAS[name], lr=1e-2, weight_decay=0.1
        )
        for r in ranks:
            assert_params_close(r[name]["state"], want, REL)
        # equal halves: the mean of the ranks' losses is the whole batch's
        mean = [(a + b) / 2 for a, b in zip(ranks[0][name]["losses"], ranks[1][name]["losses"], strict=True)]
        assert_losses_close(mean, want_losses)


@pytest.mark.parametrize(("param", "opt"), PLACEMENTS)
def test_two_ranks_step_what_any_rank_used(tmp_path: Path, param: str, opt: str) -> None:
    _check(tmp_path, param, opt, overlap=False)


def test_two_ranks_overlapped_step(tmp_path: Path) -> None:
    _check(tmp_path, "nvme", "nvme", overlap=True)


def _mask_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from engine_support import MLP

    import tiered

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        with tiered.initialize(MLP(), ds_config(param="cpu", opt="cpu")) as engine:
            zp = engine.zero
            groups = [g for g in zp.groups if g.trainable]
            for k, g in enumerate(groups):  # rank r "received" entry j of group k iff (j + k + r) % 3 == 0
                zp.received_local(g).copy_(
                    torch.tensor([(j + k + rank) % 3 == 0 for j in range(len(g.entries))], dtype=torch.uint8)
                )
            masks = zp.received_across_ranks(groups)
            torch.save([m.tolist() for m in masks], os.path.join(out_dir, f"mask{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_received_is_the_or_over_ranks(tmp_path: Path) -> None:
    mp.start_processes(
        _mask_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=True
    )
    got = [torch.load(tmp_path / f"mask{r}.pt") for r in range(2)]
    assert got[0] == got[1]
    for k, m in enumerate(got[0]):
        assert m == [int((j + k) % 3 == 0 or (j + k + 1) % 3 == 0) for j in range(len(m))]
