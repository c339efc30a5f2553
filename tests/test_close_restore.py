"""`engine.close()` gives the weights back group by group ([Note: restore at close group by
group]): while it restores, the tiers' resident bytes plus the copies restored so far never pass
the tiers' peak plus one group, read from the tier manager's own accounting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import ds_config

import tiered

GROUPS = 8
WIDTH = 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(GROUPS)])


def _train_one_step(engine: Any) -> None:
    x = torch.randn(4, WIDTH)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("opt", ["cpu", "nvme"])
def test_close_holds_the_tiers_peak_plus_one_group(tmp_path: Path, opt: str) -> None:
    model = _model()
    # one Linear per group: sub_group_size is one weight's elements
    config = ds_config(param="cpu", opt=opt, nvme_path=str(tmp_path / "nvme"), sub_group_size=WIDTH * WIDTH)
    engine = tiered.initialize(model, config)
    _train_one_step(engine)
    want = engine.state_dict_fp32()
    tm, zp = engine.tm, engine.zero
    assert len(zp.runtimes) == GROUPS
    memory = [t for t in tm.tier_names if tm.tier(t).backend.capabilities.memory_like]
    tier_peak = sum(tm.peak_bytes(t) for t in memory)
    one_group = WIDTH * WIDTH * 4  # fp32: the compute dtype's copy of one group
    seen: list[tuple[int, int]] = []  # (resident in the tiers, bytes restored before) per gather
    restored_before = 0
    gather = zp._gather

    def observed_gather(i: int, *, record: bool = True) -> None:
        nonlocal restored_before
        gather(i, record=record)
        seen.append((sum(tm.resident_bytes(t) for t in memory), restored_before))
        # every group gathered at close is copied out and kept (on the module, or until the
        # end of close): count it as restored from the next gather on
        restored_before += zp.runtimes[i].group.full_numel * 4

    zp._gather = observed_gather  # type: ignore[method-assign]
    engine.close()
    assert len(seen) == GROUPS
    worst = max(resident + before + one_group for resident, before in seen)
    assert worst <= tier_peak + one_group, (
        f"close held {worst} bytes (tiers + restored copies) at its worst, more than the tiers' peak "
        f"{tier_peak} + one group {one_group}: {seen}"
    )
    got = dict(model.named_parameters())
    assert all(torch.equal(got[k].detach(), v) for k, v in want.items())
    assert torch.isfinite(model(torch.randn(2, WIDTH))).all()  # plain PyTorch again
