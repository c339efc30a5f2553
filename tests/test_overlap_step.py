"""tiered.overlap_step_with_backward: each group steps as soon as its gradients are complete,
while backward goes on; the result must be exactly the step after backward (and plain PyTorch).
See [Note: step overlapped with backward] in tiered/optim/offload.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_support import (
    CASES,
    REL,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    make_batches,
    reference_train,
    tiered_train,
)
from torch import nn

import tiered


def overlapped(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**cfg, "tiered": {**cfg.get("tiered", {}), "overlap_step_with_backward": True}}


@pytest.mark.parametrize(
    ("param", "opt"), [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "cpu"), ("none", "nvme")]
)
def test_overlapped_step_equals_plain_pytorch_and_the_step_after_backward(
    tmp_path: Any, param: str, opt: str
) -> None:
    case = CASES["llama"]
    batches = make_batches(case, 3, 4)
    want_losses, want = reference_train(build(case), case, batches)
    base = ds_config(param=param, opt=opt, nvme_path=str(tmp_path / "a"))
    got_losses, got, stats = tiered_train(build(case), case, batches, overlapped(base))
    assert stats["optimizer"]["total"]["overlapped_steps"] == 3
    # every group was handed over during backward, none left for engine.step()
    assert (
        stats["optimizer"]["last_step"]["groups_ready_in_backward"]
        == stats["optimizer"]["groups_cpu"] + stats["optimizer"]["groups_gpu"]
    )
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)
    # the same per-group arithmetic as the step after backward: bitwise equal
    seq_losses, seq, seq_stats = tiered_train(
        build(case), case, batches, ds_config(param=param, opt=opt, nvme_path=str(tmp_path / "b"))
    )
    assert seq_stats["optimizer"]["total"]["overlapped_steps"] == 0
    assert seq_losses == got_losses
    for name, t in seq.items():
        assert torch.equal(got[name], t), name


def test_overlap_with_accumulation_and_an_untaken_branch(tmp_path: Any) -> None:
    # gas=2: only the boundary backward steps; the branch not taken has no gradient and is
    # stepped (with zeros) when engine.step() finishes the overlapped step
    case = CASES["branch"]
    batches = make_batches(case, 4, 4, gas=2)
    want_losses, want = reference_train(build(case), case, batches, gas=2)
    cfg = overlapped(ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "n"), gas=2))
    got_losses, got, stats = tiered_train(build(case), case, batches, cfg)
    assert stats["optimizer"]["total"]["overlapped_steps"] == 4
    n = stats["optimizer"]["groups_cpu"] + stats["optimizer"]["groups_gpu"]
    assert (
        0 < stats["optimizer"]["last_step"]["groups_ready_in_backward"] < n
    )  # the untaken branch came at step()
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)


@pytest.mark.parametrize("what", ["clip", "fp16"])
def test_overlap_is_not_used_where_the_whole_gradient_is_needed_first(
    tmp_path: Any, caplog: Any, what: str
) -> None:
    kw = {"clip": 0.5} if what == "clip" else {"dtype": "fp16"}
    cfg = overlapped(ds_config(param="cpu", opt="cpu", **kw))
    with caplog.at_level(logging.WARNING, logger="tiered"):
        with tiered.initialize(build(CASES["mlp"]), cfg) as engine:
            assert engine.overlap_step is False
    assert "overlap_step_with_backward has no effect" in caplog.text
    assert ("gradient_clipping" if what == "clip" else "fp16") in caplog.text


class ReusesAWeightAfterItsGradient(nn.Module):
    """Uses `last.weight` (detached) in an op whose backward runs after last.weight's gradient
    is complete: with the step overlapped, that use would see updated values."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        z = F.linear(h, self.last.weight.detach())
        return self.last(torch.tanh(z)).square().mean()


def test_a_weight_used_after_its_gradient_is_a_clear_error_not_a_silent_one(tmp_path: Any) -> None:
    cfg = ds_config(param="cpu", opt="cpu")
    torch.manual_seed(0)
    with tiered.initialize(ReusesAWeightAfterItsGradient(), cfg) as engine:  # fine without overlap
        loss = engine(torch.randn(4, 8))
        engine.backward(loss)
        engine.step()
    torch.manual_seed(0)
    with tiered.initialize(ReusesAWeightAfterItsGradient(), overlapped(cfg)) as engine:
        loss = engine(torch.randn(4, 8))
        with pytest.raises(
            RuntimeError,
            match="overlap_step_with_backward: group .* set tiered.overlap_step_with_"
            "backward to false|Set tiered.overlap_step_with_backward to false",
        ):
            engine.backward(loss)
        assert not engine.optimizer.overlapped_step_running  # aborted, nothing left waiting


def test_reading_parameters_mid_step_is_refused(tmp_path: Any) -> None:
    cfg = overlapped(ds_config(param="cpu", opt="cpu"))
    with tiered.initialize(build(CASES["mlp"]), cfg) as engine:
        b = make_batches(CASES["mlp"], 1, 4)[0]
        engine.backward(engine(**b))
        for call in (engine.state_dict_fp32, engine.flush):
            with pytest.raises(RuntimeError, match="call engine.step"):
                call()
        engine.step()
        assert engine.state_dict_fp32()  # fine once the step ended


def test_close_between_backward_and_step_does_not_hang(tmp_path: Any) -> None:
    cfg = overlapped(ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "n")))
    engine = tiered.initialize(build(CASES["mlp"]), cfg)
    b = make_batches(CASES["mlp"], 1, 4)[0]
    engine.backward(engine(**b))
    assert engine.optimizer.overlapped_step_running
    engine.close()  # the groups already queued finish; nothing waits for a step() that never comes
    assert not engine.optimizer.overlapped_step_running
