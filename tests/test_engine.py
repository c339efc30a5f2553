"""Engine API semantics (DeepSpeed's step/backward contract, stats, close) and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from engine_support import (
    CASES,
    MLP,
    assert_params_close,
    build,
    ds_config,
    make_batches,
    reference_train,
)

import tiered
from tiered.errors import CapacityError, ConfigError, ShapeMutationError, TieredError


def mlp_batch(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 16, generator=g), "y": torch.randn(n, 8, generator=g)}


def test_step_acts_only_at_the_accumulation_boundary(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with tiered.initialize(MLP(), ds_config(param="cpu", opt="cpu", gas=3)) as engine:
        before = {k: v.clone() for k, v in engine.zero.gather_full_state_dict().items()}
        for i in range(2):
            engine.backward(engine(**mlp_batch(seed=i)))
            engine.step()
            assert engine.optimizer.step_count == 0 and engine.global_steps == 0
        after_two = engine.zero.gather_full_state_dict()
        assert all(torch.equal(before[k], after_two[k]) for k in before), "params changed before the boundary"
        engine.backward(engine(**mlp_batch(seed=2)))
        engine.step()
        assert engine.optimizer.step_count == 1 and engine.global_steps == 1 and engine.micro_steps == 3
        after = engine.zero.gather_full_state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)


def test_stats_are_json_and_name_every_layer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"))
    with tiered.initialize(MLP(), cfg) as engine:
        for i in range(2):
            engine.backward(engine(**mlp_batch(seed=i)))
            engine.step()
        st = engine.stats()
        json.dumps(st)
        assert set(st) >= {"tiers", "zero", "optimizer", "timing", "loss_scale", "global_steps"}
        assert st["optimizer"]["last_step"]["compute_s"] > 0
        assert st["timing"]["last_step"]["forward_s"] > 0 and st["timing"]["last_step"]["step_s"] > 0
        assert st["global_steps"] == 2 and st["loss_scale"] == 1.0
        assert engine.get_lr() == [pytest.approx(1e-3)]
        assert st["capacity"]["cpu"]["pipeline"] > 0  # optimizer states staged through cpu


def test_close_is_idempotent_and_use_after_close_is_clear(tmp_path: Path) -> None:
    torch.manual_seed(0)
    engine = tiered.initialize(MLP(), ds_config(opt="cpu"))
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine(**mlp_batch())


def test_backward_rejects_non_scalar_loss() -> None:
    torch.manual_seed(0)
    with tiered.initialize(MLP(), ds_config()) as engine:
        with pytest.raises(ValueError, match="scalar"):
            engine.backward(torch.ones(3, requires_grad=True))


def test_non_tensor_outputs_pass_through() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            return {"y": self.lin(x), "n": 3, "none": None, "tag": "ok"}

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.odd = Odd()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.odd(x)
            assert out["n"] == 3 and out["none"] is None and out["tag"] == "ok"
            return out["y"].pow(2).mean()

    torch.manual_seed(0)
    ref = Top()
    torch.manual_seed(0)
    with tiered.initialize(Top(), ds_config(param="cpu", opt="cpu")) as engine:
        x = torch.randn(2, 4)
        for _ in range(2):
            engine.backward(engine(x))
            engine.step()
        got = engine.zero.gather_full_state_dict()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(2):
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    assert_params_close(got, dict(ref.named_parameters()), 1e-5)


def test_fp16_overflow_skips_the_step_and_halves_the_scale() -> None:
    case = CASES["mlp"]
    batches = [{k: v.half() for k, v in b.items()} for b in make_batches(case, 4, 4)]
    bad = {k: v.clone() for k, v in batches[1].items()}
    bad["x"][0, 0] = float("inf")  # -> inf/nan gradients on this micro-batch
    cfg = ds_config(
        opt="cpu",
        param="cpu",
        dtype="fp16",
        fp16={"initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000},
    )
    with tiered.initialize(build(case), cfg) as engine:
        scales = []
        for b in [batches[0], bad, batches[2], batches[3]]:
            engine.backward(engine(**b))
            engine.step()
            scales.append(engine.loss_scale)
        got = {k: v.float() for k, v in engine.zero.gather_full_state_dict().items()}
        assert engine.skipped_steps == 1 and engine.global_steps == 4 and engine.optimizer.step_count == 3
    assert scales == [256.0, 128.0, 128.0, 128.0]
    # the skipped step left no trace: equal to fp16 torch training on the three good batches
    _, want = reference_train(build(case), case, [batches[0], batches[2], batches[3]], dtype=torch.float16)
    assert_params_close(got, want, 1e-2)


# ---- bad input ---------------------------------------------------------------------------------
def test_gpu_budget_too_small_fails_before_training_with_the_needed_size() -> None:
    torch.manual_seed(0)
    cfg = ds_config(param="cpu", opt="cpu", gpu_budget=1024)
    with pytest.raises(CapacityError) as ei:
        tiered.initialize(MLP(), cfg)
    msg = str(ei.value)
    assert "gpu" in msg and "budget" in msg and any(ch.isdigit() for ch in msg)


def test_cpu_budget_too_small_for_the_optimizer_pipeline(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), cpu_budget=30 * 1024)
    with pytest.raises(
        CapacityError, match=r"cpu budget 30\.00 KiB < .* needed .*optimizer pipeline.*buffer_count"
    ):
        tiered.initialize(MLP(), cfg)


def test_nvme_path_not_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "nvme"
    with pytest.raises(TieredError, match="a_file"):
        tiered.initialize(MLP(), ds_config(param="nvme", opt="nvme", nvme_path=str(bad), mkdir=False))


def test_incompatible_options() -> None:
    cfg = ds_config(param="cpu", opt="cpu")
    cfg["zero_optimization"]["stage"] = 2  # DeepSpeed rejects offload_param below stage 3
    with pytest.raises(ConfigError, match="offload_param"):
        tiered.initialize(MLP(), cfg)
    both = ds_config(dtype="bf16")
    both["fp16"] = {"enabled": True}
    with pytest.raises(ConfigError, match="fp16|bf16"):
        tiered.initialize(MLP(), both)


def test_model_that_mutates_a_parameter_shape() -> None:
    torch.manual_seed(0)
    model = MLP()
    with tiered.initialize(model, ds_config(param="cpu", opt="cpu")) as engine:
        engine.backward(engine(**mlp_batch()))
        engine.step()
        model.mid.weight.data = torch.zeros(3, 3)
        with pytest.raises(ShapeMutationError, match="mid.weight"):
            engine(**mlp_batch())


def test_loss_is_unchanged_by_backward_scaling() -> None:
    # backward divides by gas internally; the user's loss tensor is untouched
    torch.manual_seed(0)
    with tiered.initialize(MLP(), ds_config(gas=4)) as engine:
        loss = engine(**mlp_batch())
        v = float(loss.detach())
        engine.backward(loss)
        assert float(loss.detach()) == v and math.isfinite(v)


def test_every_error_is_importable_from_the_package() -> None:
    """A user catches what the engine raises as tiered.<Name>, as docs/architecture.md's one errors module
    promises: every exception and warning class of tiered.errors is exported at the top level."""
    import inspect

    import tiered.errors

    public = {
        name for name, obj in vars(tiered.errors).items()
        if inspect.isclass(obj) and issubclass(obj, (Exception, Warning)) and obj.__module__ == "tiered.errors"
    }  # fmt: skip
    assert public, "tiered.errors defines no classes?"
    missing = sorted(
        name for name in public if getattr(tiered, name, None) is not getattr(tiered.errors, name)
    )
    assert not missing, f"not exported by tiered: {missing}"
    assert public <= set(tiered.__all__)
