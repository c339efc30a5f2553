"""The optimizer pipeline steps a group whose states are staged in tiles of at most
sub_group_size elements ([Note: sub-group pipeline]): bitwise the untiled step, its staging
bounded by buffer_count x tile, and the count `pipeline_bytes` returns is what the pipeline
allocates and what the engine checks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from checkpoint_support import assert_bitwise_equal, full_state, train
from engine_support import (
    MLP,
    Case,
    _mlp_batch,
    assert_losses_close,
    assert_params_close,
    ds_config,
    make_batches,
    reference_train,
)
from test_optimizer_offload import config, make_groups, make_tm, read, set_grad

import tiered
from tiered.optim.offload import OffloadedAdam
from tiered.optim.placement import MIN_TILE_NUMEL, pipeline_bytes
from tiered.optim.runs import ParamHyper
from tiered.shards import ParamEntry, ShardGroup

TILE = MIN_TILE_NUMEL
SIZES = [5 * TILE - 1234, 70_000, 100]  # 5 tiles (the last one short), 2 tiles, 1


class _Received:
    """Entry w1b gets no gradient in the second step (its runs cut across tiles)."""

    def __init__(self) -> None:
        self.step = 0

    def _mask(self, g: ShardGroup) -> torch.Tensor:
        return torch.tensor(
            [0 if (e.name == "w1b" and self.step == 2) else 1 for e in g.entries], dtype=torch.uint8
        )

    def received_local(self, group: ShardGroup) -> torch.Tensor:
        return self._mask(group)

    def received_across_ranks(self, groups: Any) -> list[torch.Tensor]:
        self.step += 1
        return [self._mask(g) for g in groups]


def _groups(tm: Any, init: list[torch.Tensor], *, param_home: str, dtype: torch.dtype) -> list[ShardGroup]:
    groups = make_groups(tm, init, param_home=param_home, grad_home="cpu", dtype=dtype)
    g = groups[1]  # three entries of their own hyper-parameters
    a, b = 30_000, 20_000
    entries = (
        ParamEntry("w1a", 0, a, (a,)),
        ParamEntry("w1b", a, b, (b,)),
        ParamEntry("w1c", a + b, g.shard_numel - a - b, (g.shard_numel - a - b,)),
    )
    groups[1] = replace(g, entries=entries)
    return groups


def _run(
    tmp_path: Any,
    *,
    sub_group_size: int,
    opt_tier: str,
    param_home: str,
    dtype: torch.dtype,
    buffer_count: int = 2,
) -> tuple[dict[str, torch.Tensor], OffloadedAdam, Any, int]:
    torch.manual_seed(0)
    init = [torch.randn(n) for n in SIZES]
    tm = make_tm(tmp_path / f"t{sub_group_size}")
    groups = _groups(tm, init, param_home=param_home, dtype=dtype)
    cfg = config(opt_tier, buffer_count=buffer_count)
    # max_in_cpu 0: no new parameter stays cached in "cpu" after its step ([Note: max_in_cpu]), so
    # what "cpu" holds beyond the homes is the pipeline's staging alone
    z = cfg.zero
    cfg = replace(
        cfg,
        zero=replace(
            z, sub_group_size_numel=sub_group_size, offload_param=replace(z.offload_param, max_in_cpu_numel=0)
        ),
    )
    masters = {g.name: w.clone() for g, w in zip(groups, init, strict=True)}
    opt = OffloadedAdam(
        tm,
        groups,
        cfg,
        lambda g: masters.pop(g.name),
        optimizer_tier=opt_tier,
        compute_dtype=dtype,
        param_hyper={"w1a": ParamHyper(0.0, 0.5), "w1c": ParamHyper(0.3, 2.0)},
        grads_received=_Received(),
    )
    base = tm.resident_bytes("cpu")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for g in groups:
            set_grad(tm, g, torch.randn(g.shard_numel, generator=gen))
        opt.step(1e-2)
    opt.wait_writes()
    staged = tm.peak_bytes("cpu") - base  # (the reads below leave copies in "cpu")
    out: dict[str, torch.Tensor] = {}
    for i, g in enumerate(groups):
        out[f"{g.name}.param"] = read(tm, g.param)
        out[f"{g.name}.master"] = opt.master_shard(i)
        for kind in ("exp_avg", "exp_avg_sq"):
            parts = opt.checkpoint_partitions()[g.name][kind]
            out[f"{g.name}.{kind}"] = torch.cat(
                [read(tm, p) for p in (parts if isinstance(parts, tuple) else (parts,))]
            )
    return out, opt, tm, staged


@pytest.mark.parametrize(
    ("param_home", "dtype"),
    [("gpu", torch.float32), ("cpu", torch.float32), ("nvme", torch.float32), ("nvme", torch.bfloat16)],
)
def test_tiled_step_is_bitwise_the_untiled_step(tmp_path: Any, param_home: str, dtype: torch.dtype) -> None:
    whole, opt_w, tm_w, _ = _run(
        tmp_path, sub_group_size=10**9, opt_tier="nvme", param_home=param_home, dtype=dtype
    )
    tiled, opt_t, tm_t, _ = _run(
        tmp_path, sub_group_size=TILE, opt_tier="nvme", param_home=param_home, dtype=dtype
    )
    try:
        assert [len(og.tiles) for og in opt_w.groups] == [1, 1, 1]
        assert [len(og.tiles) for og in opt_t.groups] == [5, 2, 1]
        assert {og.tiles[-1].stop - og.tiles[-1].start for og in opt_t.groups[:1]} == {TILE - 1234}
        assert whole.keys() == tiled.keys()
        for k in whole:
            assert torch.equal(whole[k], tiled[k]), k
        # w1b was not stepped in step 2: its count lags, in both
        assert opt_t.param_step_counts()["w1b"] == 2 and opt_t.param_step_counts()["w0"] == 3
    finally:
        tm_w.close()
        tm_t.close()


def test_staging_is_bounded_by_buffer_count_tiles(tmp_path: Any) -> None:
    # fp32, params and gradients at home in "cpu", states on nvme: the staging is the states alone
    got = {}
    for sgs in (10**9, TILE):
        _, opt, tm, staged = _run(
            tmp_path,
            sub_group_size=sgs,
            opt_tier="nvme",
            param_home="cpu",
            dtype=torch.float32,
            buffer_count=2,
        )
        try:
            formula = opt.stage_bytes_needed()
            assert formula == pipeline_bytes(
                [og.group for og in opt.groups],
                [og.plan for og in opt.groups],
                2,
                torch.float32,
                opt.tile_numel,
            )
            # the window of two fills: what the pipeline holds at its peak is exactly the formula
            assert staged == formula["cpu"], (sgs, staged, formula)
            got[sgs] = staged
        finally:
            tm.close()
    assert got[TILE] == 2 * 12 * TILE  # two full tiles of 3 fp32 states
    assert got[10**9] == 12 * (SIZES[0] + SIZES[1])  # the two largest groups whole


def test_formula_counts_whole_group_buffers_and_bounds_the_peak(tmp_path: Any) -> None:
    # bf16 params on nvme: the new parameter is staged whole (zero's partition), states by tile
    _, opt, tm, staged = _run(
        tmp_path,
        sub_group_size=TILE,
        opt_tier="nvme",
        param_home="nvme",
        dtype=torch.bfloat16,
        buffer_count=2,
    )
    try:
        formula = opt.stage_bytes_needed()
        assert formula == {"cpu": 2 * 12 * TILE + 2 * (SIZES[0] + SIZES[1])}
        assert 0 < staged <= formula["cpu"]
    finally:
        tm.close()


def _big() -> MLP:
    return MLP(16, 512, 8)  # mid.weight: 512 x 512 elements, a group of 4 tiles


BIG = Case("big_mlp", _big, _mlp_batch, lambda out: out)


@pytest.mark.parametrize(
    ("param", "opt", "overlap"),
    [("none", "nvme", False), ("cpu", "nvme", False), ("nvme", "nvme", False), ("cpu", "nvme", True)],
)
def test_engine_steps_in_tiles_equal_torch_adamw(tmp_path: Any, param: str, opt: str, overlap: bool) -> None:
    cfg = ds_config(
        param=param, opt=opt, nvme_path=str(tmp_path / "nvme"), sub_group_size=TILE, buffer_count=2
    )
    if overlap:
        cfg["tiered"] = {**cfg.get("tiered", {}), "overlap_step_with_backward": True}
    batches = make_batches(BIG, 3, 4)
    torch.manual_seed(0)
    ref_model = _big()
    torch.manual_seed(0)
    model = _big()
    want_losses, want = reference_train(ref_model, BIG, batches)
    with tiered.initialize(model, cfg) as engine:
        tiles = {og.name: len(og.tiles) for og in engine.optimizer.groups}
        assert max(tiles.values()) == 4, tiles  # mid.weight: 512 x 512 = 4 tiles
        # the engine checked the budget with the count the pipeline holds to
        assert engine.capacity["cpu"]["pipeline"] == engine.optimizer.stage_bytes_needed()["cpu"]
        losses = []
        for b in batches:
            loss = engine(**b)
            losses.append(float(loss.detach().float()))
            engine.backward(loss)
            engine.step()
        got = {k: v.detach().float().clone() for k, v in engine.zero.gather_full_state_dict().items()}
        if overlap:
            assert engine.optimizer.stats()["total"]["overlapped_steps"] == 3
    assert_losses_close(losses, want_losses, rel=1e-5)
    assert_params_close(got, want, rel=1e-5)


def test_checkpoint_of_a_tiled_run_resumes_bit_exact_tiled_or_not(tmp_path: Any) -> None:
    def cfg(sub_group_size: int, name: str) -> dict[str, Any]:
        return ds_config(
            param="nvme",
            opt="nvme",
            nvme_path=str(tmp_path / name),
            sub_group_size=sub_group_size,
            buffer_count=2,
        )

    batches = make_batches(BIG, 4, 4)

    def engine(config: dict[str, Any], seed: int = 0) -> Any:
        torch.manual_seed(seed)
        return tiered.initialize(_big(), config)

    with engine(cfg(TILE, "a")) as e:
        want_losses = train(e, BIG, batches)
        want = full_state(e)
    with engine(cfg(TILE, "b")) as e:
        first = train(e, BIG, batches[:2])
        e.save_checkpoint(tmp_path / "ckpt")
    for sgs, name in ((TILE, "c"), (10**9, "d")):  # into tiles again, and into whole groups
        with engine(cfg(sgs, name), seed=99) as e:
            assert max(len(og.tiles) for og in e.optimizer.groups) == (4 if sgs == TILE else 1)
            e.load_checkpoint(tmp_path / "ckpt")
            rest = train(e, BIG, batches[2:])
            got = full_state(e)
        assert first + rest == want_losses
        for k, v in want["params"].items():
            assert torch.equal(got["params"][k], v), k
        if sgs == TILE:
            assert_bitwise_equal(got, want)
