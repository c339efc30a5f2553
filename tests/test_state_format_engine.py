"""[Note: compressed optimizer state] wired into the offloaded optimizer: training with each
format against exact Adam, the bytes it moves, bitwise resume in the same format, the refusals."""

from __future__ import annotations

import pytest
import torch

import tiered
from tiered.errors import CheckpointMismatchError, UnsupportedConfigError

LOSSY = ("bf16", "int8")


def _config(fmt: str, path: str, device: str = "nvme") -> dict:
    off = {"device": device, "nvme_path": path}
    return {
        "train_batch_size": 32,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_optimizer": off, "offload_param": off},
        "tiered": {"optimizer_state_format": fmt},
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)


def _train(engine, steps: int) -> list[float]:
    x, y = _data()
    out = []
    for _ in range(steps):
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


@pytest.mark.parametrize("fmt", LOSSY)
def test_training_with_a_compressed_format_follows_exact_adam(fmt: str, tmp_path) -> None:
    # the moments' bytes on NVMe are what is compared: nothing kept in memory ([Note: residency])
    configs = [_config(f, str(tmp_path / d)) for f, d in (("fp32", "a"), (fmt, "b"))]
    for c in configs:
        c["tiered"]["residency"] = "off"
    exact = tiered.initialize(_model(), configs[0])
    comp = tiered.initialize(_model(), configs[1])
    try:
        le, lc = _train(exact, 20), _train(comp, 20)
        assert le[-1] < 0.7 * le[0]  # it learns
        for a, b in zip(le, lc, strict=True):
            assert abs(a - b) <= 0.02 * a, (le, lc)
        assert le != lc, "nothing differed: the moments were not compressed"
        # the bytes: the moments cost 4 B (bf16) or ~2 B (int8) per element instead of 8
        fe, fc = exact.stats()["bytes_per_step"], comp.stats()["bytes_per_step"]
        n = sum(og.shard_numel for og in comp.optimizer.groups)
        moments = {"bf16": 4 * n, "int8": 2 * n + 2 * 4 * -(-n // 256)}[fmt]
        assert fe["formula"]["host->disk"] - fc["formula"]["host->disk"] == 8 * n - moments
        saved = fe["measured"]["host->disk"] - fc["measured"]["host->disk"]
        assert saved >= 0.9 * (8 * n - moments), (fe, fc)
    finally:
        exact.close()
        comp.close()


@pytest.mark.parametrize("fmt", LOSSY)
def test_a_compressed_run_resumes_bitwise(fmt: str, tmp_path) -> None:
    ref = tiered.initialize(_model(), _config(fmt, str(tmp_path / "r")))
    try:
        _train(ref, 3)
        ref.save_checkpoint(str(tmp_path / "ck"), tag="t")
        want = _train(ref, 4)
    finally:
        ref.close()
    again = tiered.initialize(_model(), _config(fmt, str(tmp_path / "s")))
    try:
        again.load_checkpoint(str(tmp_path / "ck"), tag="t")
        got = _train(again, 4)
    finally:
        again.close()
    assert got == want  # the same losses bit for bit: the same moments and the same rounding


@pytest.mark.parametrize(
    ("saved", "running"), [("fp32", "bf16"), ("fp32", "int8"), ("bf16", "int8"), ("int8", "bf16")]
)
def test_a_checkpoint_of_another_format_is_refused_by_name(saved: str, running: str, tmp_path) -> None:
    a = tiered.initialize(_model(), _config(saved, str(tmp_path / "a")))
    try:
        _train(a, 1)
        a.save_checkpoint(str(tmp_path / "ck"), tag="t")
    finally:
        a.close()
    b = tiered.initialize(_model(), _config(running, str(tmp_path / "b")))
    try:
        with pytest.raises(
            CheckpointMismatchError, match=rf"format '{saved}', this run stores it as '{running}'"
        ):
            b.load_checkpoint(str(tmp_path / "ck"), tag="t")
    finally:
        b.close()


@pytest.mark.parametrize("fmt", LOSSY)
def test_a_compressed_format_with_state_on_the_gpu_is_refused_by_name(fmt: str, tmp_path) -> None:
    cfg = _config(fmt, str(tmp_path))
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    with pytest.raises(
        UnsupportedConfigError, match=rf"optimizer_state_format = '{fmt}' compresses offloaded"
    ):
        tiered.initialize(_model(), cfg)


@pytest.mark.parametrize("fmt", LOSSY)
def test_decode_scratch_is_one_pair_for_every_tile_and_counted_by_the_plan(fmt: str, tmp_path) -> None:
    """The step decodes each tile's moments into one fp32 pair allocated with the optimizer (no
    allocation per tile per step), of the largest tile's size, and the memory model counts those
    8 B per element among the host bytes outside the tiers ([Note: one memory model])."""
    import copy

    from tiered.config.loader import load_config
    from tiered.optim.placement import MIN_TILE_NUMEL
    from tiered.planning.needs import outside_tiers_bytes, predict

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))

    config = _config(fmt, str(tmp_path / "s"))
    config["zero_optimization"]["sub_group_size"] = MIN_TILE_NUMEL  # the 512 x 512 weight: 4 tiles
    engine = tiered.initialize(model(), copy.deepcopy(config))
    try:
        decoded = engine.optimizer._decoded
        assert decoded is not None
        tiles = [b.stop - b.start for og in engine.optimizer.groups for b in og.tiles]
        assert len(tiles) > len(engine.optimizer.groups), "the groups were not tiled"
        assert decoded[0].numel() == decoded[1].numel() == max(tiles)
        ptrs = [t.data_ptr() for t in decoded]
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            engine.backward(engine(x).square().mean())
            engine.step()
        assert [t.data_ptr() for t in engine.optimizer._decoded] == ptrs
    finally:
        engine.close()
    m = model()
    pred = predict(m, load_config(copy.deepcopy(config), model=m))
    assert pred.outside_tiers_bytes == outside_tiers_bytes(pred.groups) + 8 * max(tiles)
    exact = predict(m, load_config(copy.deepcopy(_config("fp32", str(tmp_path / "e"))), model=m))
    assert exact.outside_tiers_bytes == outside_tiers_bytes(exact.groups)
