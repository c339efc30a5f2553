"""Two gloo ranks on one machine: sharded grads equal the one-rank grads of the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp
from zero_support import MLP, dist_grad_worker, free_port, tiny_gpt2


def _run(tmp_path, world: int, dtype_name: str = "float32"):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=dist_grad_worker, args=(r, world, port, str(tmp_path), dtype_name))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)  # never hang: a stuck rank is killed and the test fails
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * world
    return {r: torch.load(tmp_path / f"result{r}.pt", weights_only=False) for r in range(world)}


def _reference(kind: str):
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP(d=24, depth=3)
        init = copy.deepcopy(model)
        for x in torch.randn(2, 8, 24):
            model(x).pow(2).mean().backward()
    else:
        model = tiny_gpt2()
        init = copy.deepcopy(model)
        for ids in torch.randint(0, 64, (2, 4, 16)):
            model(input_ids=ids, labels=ids).loss.backward()
    return init, {n: p.grad.reshape(-1) for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
def test_two_gloo_ranks_equal_one_rank_on_the_global_batch(tmp_path_factory, kind):
    results = _two_rank_results(tmp_path_factory)
    init, ref_grads = _reference(kind)  # plain PyTorch on the whole global batch
    total_sq = 0.0
    for rank in range(2):
        shards, entries, sq, sd, gpu_peak = results[rank][kind]
        total_sq += sq
        for gname, (shard_off, shard_numel, shard) in shards.items():
            assert shard.numel() == shard_numel and shard_off == rank * shard_numel
            for e in entries[gname]:
                lo, hi = max(e.offset, shard_off), min(e.offset + e.numel, shard_off + shard_numel)
                if hi > lo:
                    torch.testing.assert_close(
                        shard[lo - shard_off : hi - shard_off],
                        ref_grads[e.name][lo - e.offset : hi - e.offset],
                        rtol=1e-5,
                        atol=1e-7,
                    )
        for n, p in init.named_parameters():  # every rank reassembles the full parameters
            assert torch.equal(sd[n], p.detach())
        assert gpu_peak <= 256 * 1024
    expect = sum(float(g.pow(2).sum()) for g in ref_grads.values())
    assert abs(total_sq - expect) / expect < 1e-5  # sum over ranks of local shard norms = global norm


_RESULTS: dict = {}


def _two_rank_results(tmp_path_factory):
    """Both models run in one pair of processes (spawning costs seconds), shared by the cases."""
    if not _RESULTS:
        _RESULTS.update(_run(tmp_path_factory.mktemp("dist"), 2))
    return _RESULTS
