"""Reading the optimizer state of a compressed-format run (bf16, int8; [Note: compressed optimizer
state]): the live read (deepspeed.utils.safe_get_*_optimizer_state) and the checkpoint read
(tiered.checkpoint.read_parameters) give the fp32 moments the optimizer decodes, on any tiling
([Note: safe getters over tiles and formats], [Note: compressed moments read decoded])."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_state_format_load import _config, _decoded, _model, _train

import tiered
from tiered.checkpoint import read_parameters
from tiered.checkpoint.decode_load import moment_decoder
from tiered.deepspeed import utils as ds_utils
from tiered.optim import offload
from tiered.optim.placement import MIN_TILE_NUMEL

MOMENTS = ("exp_avg", "exp_avg_sq")
TILINGS = {"one-tile": None, "tiled": MIN_TILE_NUMEL}  # tiled: the 512 x 300 weight in several tiles


def _moments_the_next_step_decodes(engine: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Runs one more step and returns, per moment and parameter, the fp32 values that step's
    update started from: the optimizer's own decoded tiles, captured as it hands them to the kernel."""
    seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    where: dict[int, tuple[int, int]] = {}
    update, kernel = offload.OffloadedAdam._update, offload.adam_update

    def spy_update(self: Any, i: int, j: int, *args: Any, **kw: Any) -> None:
        where[threading.get_ident()] = (i, j)
        update(self, i, j, *args, **kw)

    def spy_kernel(opt: Any, runs: Any, side: Any, tensors: Any, *args: Any, **kw: Any) -> None:
        seen[where[threading.get_ident()]] = (tensors[2].clone(), tensors[3].clone())
        kernel(opt, runs, side, tensors, *args, **kw)

    monkeypatch.setattr(offload.OffloadedAdam, "_update", spy_update)
    monkeypatch.setattr(offload, "adam_update", spy_kernel)
    _train(engine, 1)
    monkeypatch.undo()
    out: dict[str, dict[str, Any]] = {k: {} for k in MOMENTS}
    for i, og in enumerate(engine.optimizer.groups):
        for k, kind in enumerate(MOMENTS):
            shard = torch.cat([seen[(i, j)][k] for j in range(len(og.tiles))])
            for e in og.group.entries:
                s_shard, s_param, n = og.group.shard_slice(e)
                assert (s_param, n) == (0, e.numel)  # one rank: the whole parameter
                out[kind][e.name] = shard[s_shard : s_shard + n].view(e.shape)
    return out


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_live_moments_are_the_values_the_next_step_decodes(
    fmt: str, tiling: str, tmp_path, monkeypatch
) -> None:
    model = _model()
    with tiered.initialize(model, _config(fmt, str(tmp_path / "a"), TILINGS[tiling])) as e:
        if tiling == "tiled":
            assert max(len(og.tiles) for og in e.optimizer.groups) > 1, "not tiled: the test proves nothing"
        _train(e, 2)
        got = {
            kind: {n: ds_utils.safe_get_full_optimizer_state(p, kind) for n, p in model.named_parameters()}
            for kind in MOMENTS
        }
        local = {
            n: ds_utils.safe_get_local_optimizer_state(p, "exp_avg") for n, p in model.named_parameters()
        }
        masters = {n: ds_utils.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        want = _moments_the_next_step_decodes(e, monkeypatch)
    for kind in MOMENTS:
        for name, w in want[kind].items():
            g = got[kind][name]
            assert g.dtype == torch.float32 and g.shape == w.shape
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), (kind, name)
            assert w.abs().sum() > 0, "nothing was stepped: the test proves nothing"
    assert all(torch.equal(local[n], got["exp_avg"][n].reshape(-1)) for n in local)
    assert all(m is not None and m.dtype == torch.float32 for m in masters.values())


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_checkpoint_moments_read_decoded_in_fp32_on_any_tiling(fmt: str, tmp_path) -> None:
    """The checkpoint read against decoding the saved tiles by hand and against the live read."""
    model = _model()
    with tiered.initialize(model, _config(fmt, str(tmp_path / "a"), MIN_TILE_NUMEL)) as e:
        _train(e, 3)
        e.save_checkpoint(str(tmp_path / "ck"), tag="t")
        live = {
            kind: {n: ds_utils.safe_get_full_optimizer_state(p, kind) for n, p in model.named_parameters()}
            for kind in MOMENTS
        }
    for kind in MOMENTS:
        got = read_parameters(str(tmp_path / "ck"), "t", kind=kind)
        want = _decoded(str(tmp_path / "ck" / "t"), fmt, kind)
        assert got.keys() == want.keys() == live[kind].keys()
        for name in want:
            assert got[name].dtype == torch.float32, (kind, name)
            assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), (kind, name)
            assert torch.equal(got[name], live[kind][name]), (kind, name)


def test_int8_moments_are_not_written_but_refused_by_name(tmp_path) -> None:
    """A write would re-encode whole blocks, rounding their other elements: refused, nothing changed."""
    model = _model()
    with tiered.initialize(model, _config("int8", str(tmp_path / "a"))) as e:
        _train(e, 1)
        w = model[2].weight
        before = ds_utils.safe_get_full_optimizer_state(w, "exp_avg")
        with pytest.raises(
            ValueError, match=r"2\.weight: cannot write exp_avg: .*'int8' stores it as block codes"
        ):
            ds_utils.safe_set_full_optimizer_state(w, torch.ones(300, 512), "exp_avg")
        assert torch.equal(ds_utils.safe_get_full_optimizer_state(w, "exp_avg"), before)
        ds_utils.safe_set_full_fp32_param(w, torch.full((300, 512), 0.5))  # the master is fp32 as ever
        assert bool((ds_utils.safe_get_full_fp32_param(w) == 0.5).all())


def test_a_format_without_a_codec_is_refused_naming_it() -> None:
    assert moment_decoder("int8", "exp_avg_sq", "ck").name == "int8 exp_avg_sq"
    with pytest.raises(ValueError, match=r"checkpoint ck holds exp_avg in optimizer-state format 'int4'"):
        moment_decoder("int4", "exp_avg", "ck")
