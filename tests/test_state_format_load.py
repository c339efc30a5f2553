"""A checkpoint of compressed moments (bf16, int8) loaded into an fp32 run: decoded exactly, on
any tiling ([Note: compressed optimizer state]; tiered/checkpoint/decode_load.py)."""

from __future__ import annotations

import os

import pytest
import torch

import tiered
from tiered.checkpoint.consolidate import read_parameters
from tiered.optim.placement import MIN_TILE_NUMEL
from tiered.optim.state_format import FORMATS

LOSSY = ("bf16", "int8")


def _config(fmt: str, path: str, sub_group_size: int | None = None, device: str = "nvme") -> dict:
    off = {"device": device, "nvme_path": path}
    zero: dict = {"stage": 3, "offload_optimizer": off, "offload_param": off}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    return {
        "train_batch_size": 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "tiered": {"optimizer_state_format": fmt},
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 300))


def _train(engine, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 300, generator=g)
    out = []
    for _ in range(steps):
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def _decoded(path: str, fmt: str, kind: str) -> dict[str, torch.Tensor]:
    """The oracle: every parameter's moment as the saved format's codec decodes the saved bytes,
    tile by tile as the manifest records the tiles."""
    from safetensors import safe_open

    from tiered.checkpoint import directory as d

    m = d.read_manifest(path)
    codec = getattr(FORMATS[fmt], kind)
    shards: dict[tuple[int, str], torch.Tensor] = {}
    for lay in m["ranks"]:
        with safe_open(os.path.join(path, lay["file"]), "pt") as f:
            for g in lay["groups"]:
                if kind not in g["tensors"]:
                    continue
                raw = f.get_tensor(g["tensors"][kind]).reshape(-1).view(torch.uint8)
                parts, at = [], 0
                tiles = g["tile_bytes"] if fmt == "int8" else [raw.numel()]
                for tb in tiles:
                    out = torch.empty(codec.decoded_numel(tb))
                    codec.decode(raw[at : at + tb].clone(), out)
                    parts.append(out)
                    at += tb
                shards[(lay["rank"], g["name"])] = torch.cat(parts)
    got = {}
    for name, info in m["parameters"].items():
        if not info["trainable"]:
            continue
        out = torch.empty(torch.Size(info["shape"]).numel())
        for p in info["pieces"]:
            s, t, n = int(p["start_in_shard"]), int(p["start_in_param"]), int(p["length"])
            out[t : t + n] = shards[(int(p["rank"]), p["group"])][s : s + n]
        got[name] = out.view(info["shape"])
    return got


@pytest.mark.parametrize("fmt", LOSSY)
@pytest.mark.parametrize(("tiling", "home"), [("same", "nvme"), ("other", "nvme"), ("other", "cpu")])
def test_compressed_moments_load_into_fp32_decoded_bitwise(
    fmt: str, tiling: str, home: str, tmp_path
) -> None:
    """Into a file home (the tile's swap file rewritten) and a memory home (its resident copy)."""
    small = MIN_TILE_NUMEL  # the 512 x 300 weight in several tiles
    a = tiered.initialize(_model(), _config(fmt, str(tmp_path / "a"), small))
    try:
        _train(a, 3)
        a.save_checkpoint(str(tmp_path / "ck"), tag="t")
    finally:
        a.close()
    ck = str(tmp_path / "ck" / "t")
    b = tiered.initialize(
        _model(), _config("fp32", str(tmp_path / "b"), small if tiling == "same" else 3 * small + 1000, home)
    )
    try:
        b.load_checkpoint(str(tmp_path / "ck"), tag="t")
        b.save_checkpoint(str(tmp_path / "ck2"), tag="t")  # the fp32 run's own state, as it holds it
    finally:
        b.close()
    for kind in ("exp_avg", "exp_avg_sq"):
        want = _decoded(ck, fmt, kind)
        got = read_parameters(str(tmp_path / "ck2"), "t", kind=kind)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == torch.float32
            assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), (kind, name)
            assert want[name].abs().sum() > 0, "nothing was stepped: the test proves nothing"
    from tiered.checkpoint import directory as d

    tiles = [
        sorted(
            len(g["tile_bytes"])
            for lay in d.read_manifest(str(tmp_path / c / "t"))["ranks"]
            for g in lay["groups"]
        )
        for c in ("ck", "ck2")
    ]
    assert (tiles[0] == tiles[1]) == (tiling == "same"), tiles  # "other" cuts the shards elsewhere
    masters = read_parameters(str(tmp_path / "ck"), "t"), read_parameters(str(tmp_path / "ck2"), "t")
    assert all(torch.equal(masters[0][n], masters[1][n]) for n in masters[0])


@pytest.mark.parametrize("fmt", LOSSY)
def test_a_compressed_run_resumed_in_fp32_trains_on(fmt: str, tmp_path) -> None:
    a = tiered.initialize(_model(), _config(fmt, str(tmp_path / "a")))
    try:
        first = _train(a, 5)
        a.save_checkpoint(str(tmp_path / "ck"), tag="t")
        more = _train(a, 5)
    finally:
        a.close()
    b = tiered.initialize(_model(), _config("fp32", str(tmp_path / "b")))
    try:
        b.load_checkpoint(str(tmp_path / "ck"), tag="t")
        resumed = _train(b, 5)
    finally:
        b.close()
    assert resumed[-1] < first[-1] < first[0]  # it goes on learning from where it stopped
    for x, y in zip(resumed, more, strict=True):
        assert abs(x - y) <= 0.02 * y, (resumed, more)  # the compressed run's path, within rounding


def _two_rank_worker(rank: int, world: int, port: int, tmp: str, fmt: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = _config(fmt, os.path.join(tmp, f"nvme{rank}"), MIN_TILE_NUMEL)
        cfg["train_batch_size"] = 32
        with tiered.initialize(_model(), cfg) as e:
            _train(e, 3)
            e.save_checkpoint(os.path.join(tmp, "two"), tag="t")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fmt", ["int8"])
def test_compressed_moments_of_two_ranks_load_into_one_fp32_rank(fmt: str, tmp_path) -> None:
    """Another world size: each rank's int8 tiles decode into the one rank's fp32 shard."""
    import torch.multiprocessing as mp
    from test_equivalence_dist import _free_port

    mp.start_processes(
        _two_rank_worker,
        args=(2, _free_port(), str(tmp_path), fmt),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    ck = str(tmp_path / "two" / "t")
    with tiered.initialize(_model(), _config("fp32", str(tmp_path / "b"))) as b:
        b.load_checkpoint(str(tmp_path / "two"), tag="t")
        b.save_checkpoint(str(tmp_path / "one"), tag="t")
    from tiered.checkpoint import directory as d

    saved = d.read_manifest(ck)
    assert saved["world_size"] == 2
    assert any({p["rank"] for p in info["pieces"]} == {0, 1} for info in saved["parameters"].values())
    for kind in ("exp_avg", "exp_avg_sq"):
        want = _decoded(ck, fmt, kind)
        got = read_parameters(str(tmp_path / "one"), "t", kind=kind)
        direct = read_parameters(str(tmp_path / "two"), "t", kind=kind)  # the two ranks' tiles, decoded
        for name in want:
            assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), (kind, name)
            assert torch.equal(direct[name].view(torch.int32), want[name].view(torch.int32)), (kind, name)
