"""tiered.deepspeed.initialize: DeepSpeed's 4-tuple, param groups, client optimizer and scheduler,
the engine API of ported scripts, and the bad input of each."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import MLP, ds_config, no_leftover_process_group  # noqa: F401 - the fixture

import tiered
import tiered.deepspeed as deepspeed
from tiered.deepspeed.client import offloaded_adam_takes_param_hyper
from tiered.errors import ConfigError, DistributedSetupError, UnsupportedConfigError

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 16, generator=g), "y": torch.randn(4, 8, generator=g)}


def no_optimizer(**kw: Any) -> dict[str, Any]:
    cfg = ds_config(param="cpu", opt="cpu", **kw)
    del cfg["optimizer"]
    return cfg


def torch_run(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> list[float]:
    losses = []
    for i in range(steps):
        loss = model(**batch(i))
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses


def test_client_adamw_and_lambda_scheduler_train_as_torch() -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = MLP()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.95))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: (s + 1) / 3 if s < 3 else 1.0)
    ref_losses = torch_run(ref, ref_opt, ref_sched, 5)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 3 if s < 3 else 1.0)
    engine, facade, loader, lr_sched = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=no_optimizer()
    )
    assert loader is None and lr_sched is sched and isinstance(facade, torch.optim.Optimizer)
    losses, lrs = [], []
    with engine:
        for i in range(5):
            lrs.append(engine.get_lr()[0])
            loss = engine(**batch(i))
            losses.append(float(loss))
            engine.backward(loss)
            engine.step()
            assert engine.was_step_applied()
        assert engine.global_steps == 5
        state = engine.zero.gather_full_state_dict()
    assert lrs == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2, 1e-2])
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state[n], p.detach(), atol=1e-5, rtol=0)


def test_scheduler_built_on_the_returned_optimizer_drives_the_lr() -> None:
    torch.manual_seed(0)
    engine, opt, _, _ = deepspeed.initialize(model=MLP(), config=ds_config(param="cpu", opt="cpu", lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    with engine:
        seen = []
        for i in range(3):
            seen.append(engine.get_lr()[0])
            engine.backward(engine(**batch(i)))
            engine.step()
            opt.step()  # as accelerate's wrapper does after engine.step(): a no-op
            sched.step()
        assert seen == pytest.approx([1e-2, 5e-3, 2.5e-3])
        with pytest.raises(RuntimeError, match="engine.step"):
            opt.step()  # the engine did not step since


def test_engine_api_of_ported_scripts() -> None:
    torch.manual_seed(0)
    cfg = ds_config(param="cpu", opt="cpu", gas=2, clip=1.0)
    engine, *_ = deepspeed.initialize(model=MLP(), config=cfg)
    with engine:
        assert engine.gradient_accumulation_steps() == 2 and engine.local_rank == 0
        assert engine.device.type == "cpu" and engine.get_global_grad_norm() is None
        assert engine.train() is engine and engine.module.training
        engine.eval()
        assert not engine.module.training
        engine.train()
        loss = engine(**batch(0))
        engine.backward(loss, retain_graph=True)
        engine.backward(loss)  # the retained graph runs again
        engine.zero_grad()  # drops both
        for i in range(2):
            assert engine.is_gradient_accumulation_boundary() == (i == 1)
            engine.backward(engine(**batch(i)))
            engine.step()
            assert engine.was_step_applied() == (i == 1)
        norm = engine.get_global_grad_norm()
        assert norm is not None and norm > 0


def test_zero_grad_drops_the_accumulated_gradient() -> None:
    torch.manual_seed(0)
    a, b = MLP(), MLP()
    b.load_state_dict(a.state_dict())
    results = []
    for model, noise in ((a, True), (b, False)):
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(param="cpu", opt="cpu"))
        with engine:
            if noise:
                engine.backward(engine(**batch(99)) * 100)
                engine.zero_grad()
            engine.backward(engine(**batch(0)))
            engine.step()
            results.append(engine.zero.gather_full_state_dict())
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_training_data_gives_micro_batches() -> None:
    data = [{"x": torch.randn(16), "y": torch.randn(8)} for _ in range(10)]
    engine, _, loader, _ = deepspeed.initialize(
        model=MLP(), config=ds_config(param="cpu", opt="cpu"), training_data=data
    )
    with engine:
        first = next(iter(loader))
        assert first["x"].shape == (4, 16)


@pytest.mark.parametrize("drop_last", [False, True])
def test_dataloader_drop_last_is_deepspeeds(drop_last: bool) -> None:
    # 10 samples in micro-batches of 4: DeepSpeed's loader yields 4, 4, 2, or 4, 4 with the key
    data = [{"x": torch.full((16,), float(i)), "y": torch.randn(8)} for i in range(10)]
    config = {**ds_config(param="cpu", opt="cpu"), "dataloader_drop_last": drop_last}
    engine, _, loader, _ = deepspeed.initialize(model=MLP(), config=config, training_data=data)
    with engine:
        sizes = [len(b["x"]) for b in loader]
        assert engine.dataloader_drop_last() is drop_last
    assert sizes == ([4, 4] if drop_last else [4, 4, 2])
    assert len(loader) == len(sizes)


def test_old_call_still_returns_the_engine() -> None:
    engine = tiered.initialize(MLP(), ds_config(param="cpu", opt="cpu"))
    with engine:
        assert isinstance(engine, tiered.Engine)


def _groups(model: MLP, wd: float) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def test_param_groups_with_their_own_weight_decay() -> None:
    """No-decay groups: end to end against torch AdamW with the same groups where the offloaded
    Adam takes param_hyper; refused (never ignored) where it does not."""
    torch.manual_seed(0)
    ref, model = MLP(), MLP()
    model.load_state_dict(ref.state_dict())
    cfg = ds_config(param="cpu", opt="cpu", lr=1e-2, weight_decay=0.1)
    if not offloaded_adam_takes_param_hyper():
        with pytest.raises(UnsupportedConfigError, match="weight_decay"):
            deepspeed.initialize(model=model, model_parameters=_groups(model, 0.1), config=cfg)
        return
    ref_opt = torch.optim.AdamW(_groups(ref, 0.1), lr=1e-2)
    ref_losses = torch_run(ref, ref_opt, None, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=_groups(model, 0.1), config=cfg)
    losses = []
    with engine:
        for i in range(4):
            loss = engine(**batch(i))
            losses.append(float(loss))
            engine.backward(loss)
            engine.step()
        state = engine.zero.gather_full_state_dict()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state[n], p.detach(), atol=1e-5, rtol=0)


def test_uniform_groups_need_no_per_parameter_hyper() -> None:
    model = MLP()
    cfg = ds_config(param="cpu", opt="cpu", weight_decay=0.1)
    engine, opt, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=_groups(model, 0.1)[:1] + [{"params": _groups(model, 0.1)[1]["params"]}],
        config=cfg,
    )
    with engine:
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1]


# ---- bad input ------------------------------------------------------------------------------
def test_parameters_not_of_the_model_are_named() -> None:
    model, other = MLP(), MLP()
    with pytest.raises(
        ConfigError, match=r"not parameters of the model.*group 0 item 0 \(a tensor of shape \(48, 16\)"
    ):
        deepspeed.initialize(model=model, model_parameters=list(other.parameters()), config=ds_config())


def test_a_trainable_parameter_left_out_is_named() -> None:
    model = MLP()
    with pytest.raises(ConfigError, match="out.bias"):
        deepspeed.initialize(model=model, model_parameters=list(model.parameters())[:-1], config=ds_config())


def test_a_parameter_listed_twice() -> None:
    model = MLP()
    ps = list(model.parameters())
    with pytest.raises(ConfigError, match="listed|list it once"):
        deepspeed.initialize(
            model=model, model_parameters=[{"params": ps}, {"params": ps[:1]}], config=ds_config()
        )


def test_an_optimizer_tiered_cannot_offload_is_named_with_the_supported_ones() -> None:
    model = MLP()
    with pytest.raises(UnsupportedConfigError, match=r"torch\.optim\.sgd\.SGD.*torch\.optim\.AdamW"):
        deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=no_optimizer()
        )


def test_a_client_optimizer_with_state_is_refused() -> None:
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**batch(0)).backward()
    opt.step()
    with pytest.raises(ConfigError, match="already has state"):
        deepspeed.initialize(model=model, optimizer=opt, config=no_optimizer())


def test_a_client_optimizer_overrides_the_optimizer_section(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed's rule (its initialize: the optimizer argument overrides the config's): the client's
    lr 1e-2 and no weight decay train, not the section's lr 1e-3 / weight decay 0.01; logged."""
    torch.manual_seed(0)
    ref, model = MLP(), MLP()
    model.load_state_dict(ref.state_dict())
    ref_losses = torch_run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0), None, 3)
    with caplog.at_level("WARNING", logger="tiered.deepspeed.client"):
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0),
            config=ds_config(param="cpu", opt="cpu"),
        )
    assert "the client optimizer is used" in caplog.text
    with engine:
        losses = []
        for i in range(3):
            loss = engine(**batch(i))
            losses.append(float(loss))
            engine.backward(loss)
            engine.step()
    assert losses == pytest.approx(ref_losses, abs=1e-5)


def test_amsgrad_is_refused() -> None:
    model = MLP()
    with pytest.raises(UnsupportedConfigError, match="amsgrad"):
        deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True), config=no_optimizer()
        )


def test_torchrun_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedSetupError, match="init_process_group"):
        tiered.initialize(MLP(), ds_config())
    with pytest.raises(DistributedSetupError, match="dist_init_required=False"):
        deepspeed.initialize(model=MLP(), config=ds_config(), dist_init_required=False)


def test_checkpoint_resume_with_a_client_scheduler_is_bit_exact(tmp_path: Any) -> None:
    def run(steps: int, resume: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=no_optimizer()
        )
        with engine:
            start = 0
            if resume:
                engine.load_checkpoint(tmp_path)
                start = engine.global_steps
                assert sched.last_epoch == start and engine.get_lr()[0] == pytest.approx(1e-2 * 0.7**start)
            for i in range(start, steps):
                engine.backward(engine(**batch(i)))
                engine.step()
            if not resume and steps == 2:
                engine.save_checkpoint(tmp_path)
            return engine.zero.gather_full_state_dict()

    run(2, resume=False)
    full = run(4, resume=False)
    resumed = run(4, resume=True)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_a_schedule_that_moves_groups_apart_is_refused() -> None:
    from tiered.deepspeed.facade import ClientLR

    groups = [{"lr": 1e-3}, {"lr": 2e-3}]
    lr = ClientLR(groups, [1.0, 2.0])
    assert lr.lr_at(0) == pytest.approx(1e-3)
    groups[1]["lr"] = 1e-3
    with pytest.raises(ValueError, match="param group 1 has lr 0.001, but group 0's schedule implies 0.002"):
        lr.lr_at(1)
