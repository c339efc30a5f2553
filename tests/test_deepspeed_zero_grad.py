"""DeepSpeed's GAN loop ([Note: zero_grad of the model]): the discriminator module's own
``zero_grad()`` must drop what the generator's backward put into it, as in plain PyTorch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from engine_support import MLP, ds_config, no_leftover_process_group  # noqa: F401 - the fixture

import tiered.deepspeed as deepspeed

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")

STEPS = 3


def nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    d = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    return g, d


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)


def gan_loop(net_g: nn.Module, net_d: nn.Module, backward: Any, step_d: Any, step_g: Any) -> list[float]:
    """DeepSpeedExamples' gan_deepspeed_train.py loop, shrunk: the modules' own forward and
    zero_grad, the engines' (here `backward`, `step_*`) backward and step."""
    crit = nn.BCELoss()
    losses = []
    for i in range(STEPS):
        real, noise = data(i)
        ones, zeros = torch.ones(6, 1), torch.zeros(6, 1)
        net_d.zero_grad()
        err_real = crit(net_d(real), ones)
        backward("d", err_real)
        fake = net_g(noise)
        err_fake = crit(net_d(fake.detach()), zeros)
        backward("d", err_fake)
        step_d()
        net_g.zero_grad()
        err_g = crit(net_d(fake), ones)  # its backward reaches the discriminator's parameters too
        backward("g", err_g)
        step_g()
        losses += [float(err_real + err_fake), float(err_g)]
    return losses


def torch_losses() -> list[float]:
    g, d = nets()
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    return gan_loop(g, d, lambda _which, loss: loss.backward(), opt_d.step, opt_g.step)


def no_opt_section() -> dict[str, Any]:
    cfg = ds_config(param="cpu", opt="cpu")
    del cfg["optimizer"]
    cfg["train_micro_batch_size_per_gpu"] = 6
    return cfg


def test_the_module_zero_grad_of_the_gan_example_clears_tiered_gradients() -> None:
    ref = torch_losses()
    g, d = nets()
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    # the example's config has an optimizer section as well: the client optimizers win
    cfg = {**no_opt_section(), "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.5, 0.999]}}}
    eng_d, _, _, _ = deepspeed.initialize(
        model=d, model_parameters=d.parameters(), optimizer=opt_d, config=cfg
    )
    eng_g, _, _, _ = deepspeed.initialize(
        model=g, model_parameters=g.parameters(), optimizer=opt_g, config=cfg
    )
    engines = {"d": eng_d, "g": eng_g}
    with eng_g, eng_d:
        got = gan_loop(g, d, lambda which, loss: engines[which].backward(loss), eng_d.step, eng_g.step)
    assert got == pytest.approx(ref, abs=1e-5)


def test_a_submodule_zero_grad_is_refused_and_close_gives_it_back() -> None:
    torch.manual_seed(0)
    model = MLP()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(param="cpu", opt="cpu"))
    with engine:
        with pytest.raises(RuntimeError, match=r"mid\.zero_grad\(\).*engine\.zero_grad\(\)"):
            model.mid.zero_grad()
        model.zero_grad()  # the whole model's: the engine's
    assert "zero_grad" not in model.__dict__ and "zero_grad" not in model.mid.__dict__
    model.mid.zero_grad()  # an ordinary module again


def test_the_client_optimizer_zero_grad_and_step_reach_the_engine() -> None:
    """A script still holding the optimizer it passed: zero_grad drops the gradient, step before
    engine.step() is an error (it would otherwise step nothing)."""
    torch.manual_seed(0)
    a, b = MLP(), MLP()
    b.load_state_dict(a.state_dict())
    cfg = ds_config(param="cpu", opt="cpu")
    del cfg["optimizer"]
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    finals = []
    for model, leak in ((a, True), (b, False)):
        client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=cfg)
        with engine:
            if leak:
                engine.backward(engine(x=x * 3, y=y))
                client.zero_grad()
                with pytest.raises(RuntimeError, match="engine.step"):
                    client.step()
            engine.backward(engine(x=x, y=y))
            engine.step()
            client.step()  # after engine.step(): a no-op, as accelerate's wrapper calls it
            finals.append(engine.state_dict())
    for k in finals[0]:
        torch.testing.assert_close(finals[0][k], finals[1][k], atol=0, rtol=0)
