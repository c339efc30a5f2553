"""tiered.optim.CPUAdam as a drop-in for torch.optim.AdamW / Adam: same parameters after training,
torch-compatible state_dict both ways, bf16 states, clear errors."""

from __future__ import annotations

import pytest
import torch

from tiered.optim import CPUAdam

TOL = dict(rtol=1e-6, atol=2e-7)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 5))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        y = torch.randn(16, 5, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "adamw_mode,torch_cls,wd",
    [(True, torch.optim.AdamW, 0.01), (False, torch.optim.Adam, 0.01), (True, torch.optim.AdamW, 0.0)],
)
def test_100_steps_match_torch(adamw_mode: bool, torch_cls, wd: float) -> None:
    ours, theirs = _model(), _model()
    opt_a = CPUAdam(
        ours.parameters(), lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=wd, adamw_mode=adamw_mode
    )
    opt_b = torch_cls(theirs.parameters(), lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=wd)
    la = _train(ours, opt_a, 100)
    lb = _train(theirs, opt_b, 100)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 100.0
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], **TOL)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-10)
    assert abs(la[-1] - lb[-1]) <= 1e-5 * abs(lb[-1])


def test_param_groups_and_params_without_grad() -> None:
    ours, theirs = _model(), _model()
    frozen_before = ours[2].bias.detach().clone()
    groups = lambda m: [  # noqa: E731
        {"params": [m[0].weight, m[0].bias], "lr": 1e-2},
        {"params": [m[2].weight], "weight_decay": 0.1},
        {"params": [m[2].bias]},
    ]
    ours[2].bias.requires_grad_(False)
    theirs[2].bias.requires_grad_(False)
    opt_a = CPUAdam(groups(ours), lr=1e-3)
    opt_b = torch.optim.AdamW(groups(theirs), lr=1e-3, weight_decay=0.0)
    _train(ours, opt_a, 20)
    _train(theirs, opt_b, 20)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.equal(ours[2].bias, frozen_before)
    assert ours[2].bias not in opt_a.state


def test_state_dict_round_trips_with_torch_adamw() -> None:
    # torch AdamW trains 10 steps, CPUAdam takes over from its state_dict, and the reverse; both
    # end where 20 steps of torch AdamW end.
    ref = _model()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.01)
    _train(ref, opt_ref, 10, seed=1)
    _train(ref, opt_ref, 10, seed=2)

    m1 = _model()
    t1 = torch.optim.AdamW(m1.parameters(), lr=2e-3, weight_decay=0.01)
    _train(m1, t1, 10, seed=1)
    c1 = CPUAdam(m1.parameters(), lr=2e-3, weight_decay=0.01)
    c1.load_state_dict(t1.state_dict())
    assert c1.param_groups[0]["adamw_mode"] is True
    _train(m1, c1, 10, seed=2)
    for a, b in zip(m1.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, **TOL)

    m2 = _model()
    c2 = CPUAdam(m2.parameters(), lr=2e-3, weight_decay=0.01)
    _train(m2, c2, 10, seed=1)
    sd = c2.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert isinstance(sd["state"][0]["step"], torch.Tensor)
    t2 = torch.optim.AdamW(m2.parameters(), lr=2e-3, weight_decay=0.01)
    t2.load_state_dict(sd)
    _train(m2, t2, 10, seed=2)
    for a, b in zip(m2.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_bf16_states_stay_close_to_fp32() -> None:
    """[Note: bf16 optimizer states] in tiered/optim/cpu_adam.py: an approximation, stated tolerance."""
    ours, theirs = _model(), _model()
    opt_a = CPUAdam(ours.parameters(), lr=1e-3, weight_decay=0.01, bf16_states=True)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.01)
    la = _train(ours, opt_a, 50)
    lb = _train(theirs, opt_b, 50)
    for p in ours.parameters():
        assert opt_a.state[p]["exp_avg"].dtype == torch.bfloat16
        assert opt_a.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        # 50 steps of lr 1e-3 move a parameter by <= 0.05; bf16 states change that by well under 1%.
        assert (a - b).abs().max().item() < 5e-4
    assert abs(la[-1] - lb[-1]) < 1e-2 * abs(lb[-1])
    # A state_dict with bf16 states loads back (torch casts states to the param dtype on load).
    opt_c = CPUAdam(ours.parameters(), lr=1e-3, weight_decay=0.01, bf16_states=True)
    opt_c.load_state_dict(opt_a.state_dict())
    _train(ours, opt_c, 1)
    assert all(opt_c.state[p]["exp_avg"].dtype == torch.bfloat16 for p in ours.parameters())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lr=-1.0), "lr must be"),
        (dict(betas=(1.0, 0.999)), r"betas\[0\] must be in \[0, 1\)"),
        (dict(betas=(0.9, -0.5)), r"betas\[1\] must be in \[0, 1\)"),
        (dict(eps=0.0), "eps must be"),
        (dict(weight_decay=-0.1), "weight_decay must be"),
    ],
)
def test_bad_hyperparameters(kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_wrong_parameters_are_named() -> None:
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(3,\)\) is torch.float64"
    ):
        CPUAdam([p]).step()
    q = torch.nn.Parameter(torch.zeros(4, 4).t())
    q.grad = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        CPUAdam([q]).step()


def test_closure_is_called_and_its_loss_returned() -> None:
    model = _model()
    opt = CPUAdam(model.parameters())
    x = torch.randn(4, 33)

    def closure() -> float:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    before = model[0].weight.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert not torch.equal(model[0].weight, before)


def test_a_bad_parameter_among_good_ones_steps_none_of_them() -> None:
    """The whole group goes to the kernel in one call, checked before any tensor is touched: a
    refusal names the parameter and leaves every parameter, moment and step count as it was."""
    good = [torch.nn.Parameter(torch.randn(70_000)) for _ in range(3)]
    bad = torch.nn.Parameter(torch.randn(4, 4).t())  # not contiguous
    for p in [*good, bad]:
        p.grad = torch.randn_like(p)
    opt = CPUAdam([*good, bad], lr=0.1)
    before = [p.detach().clone() for p in good]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[3\] .* not contiguous"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(good, before, strict=True))
    assert all(float(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg"].any() for p in good)
    bad.data = bad.data.contiguous()
    bad.grad = bad.grad.contiguous()
    opt.step()  # fixed: every parameter takes its first step
    assert all(float(opt.state[p]["step"]) == 1 for p in [*good, bad])
    assert not any(torch.equal(p, b) for p, b in zip(good, before, strict=True))
