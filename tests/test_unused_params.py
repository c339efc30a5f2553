"""A parameter that got no gradient in a step is not stepped, exactly as torch.optim.AdamW with
zero_grad(set_to_none=True): idle experts, a skipped branch, an auxiliary head used on one
micro-batch of a window; in every placement, overlapped, in bf16; and per-parameter weight decay
and lr scale (parameter groups) through OffloadedAdam(param_hyper=...)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from engine_support import (
    REL,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    reference_train,
    tiered_train,
)
from unused_support import CASES, make_batches

import tiered
import tiered_ext
from tiered.optim import offload
from tiered.optim.runs import ParamHyper

PLACEMENTS = [(p, o) for p in ("none", "cpu", "nvme") for o in ("none", "cpu", "nvme")]
GAS = {"moe": 1, "branch": 1, "aux": 2}


def run_pair(name: str, cfg: dict[str, Any], *, steps: int = 4, micro: int = 4, **ref: Any) -> dict[str, Any]:
    case, gas = CASES[name], GAS[name]
    batches = make_batches(name, steps, micro, gas)
    want_losses, want = reference_train(build(case), case, batches, gas=gas, lr=1e-2, **ref)
    got_losses, got, stats = tiered_train(build(case), case, batches, cfg)
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)
    return stats


def config(tmp_path: Any, name: str, param: str = "none", opt: str = "none", **kw: Any) -> dict[str, Any]:
    return ds_config(
        param=param,
        opt=opt,
        nvme_path=None if tmp_path is None else str(tmp_path / "nvme"),
        gas=GAS[name],
        lr=1e-2,
        weight_decay=0.1,
        **kw,
    )


@pytest.mark.parametrize("name", ["moe", "branch", "aux"])
@pytest.mark.parametrize(("param", "opt"), PLACEMENTS)
def test_unused_parameters_are_not_stepped_in_every_placement(
    tmp_path: Any, name: str, param: str, opt: str
) -> None:
    stats = run_pair(name, config(tmp_path, name, param, opt), weight_decay=0.1)
    assert stats["optimizer"]["step_count"] == 4


def test_the_scenarios_hold() -> None:
    # on every step some of the 8 experts get no token; the branch skips a submodule on some
    # steps; the aux weight gets a gradient in some accumulation windows only
    for name, expect_idle in (("moe", "experts."), ("branch", ""), ("aux", "head.aux")):
        model, gas = build(CASES[name]), GAS[name]
        idle_steps = 0
        for i, b in enumerate(make_batches(name, 4, 4, gas)):
            model(**b).backward()
            if (i + 1) % gas == 0:
                idle = [
                    n for n, p in model.named_parameters() if p.grad is None and n.startswith(expect_idle)
                ]
                idle_steps += bool(idle)
                if name == "moe":
                    assert 0 < len(idle) < 8 * 4
                model.zero_grad(set_to_none=True)
        assert idle_steps >= 2, name


@pytest.mark.parametrize("name", ["moe", "aux"])
@pytest.mark.parametrize(("param", "opt"), [("none", "none"), ("nvme", "nvme"), ("cpu", "nvme")])
def test_overlapped_step_skips_unused_parameters(tmp_path: Any, name: str, param: str, opt: str) -> None:
    cfg = config(tmp_path, name, param, opt)
    cfg["tiered"] = {**cfg.get("tiered", {}), "overlap_step_with_backward": True}
    stats = run_pair(name, cfg, weight_decay=0.1)
    assert stats["optimizer"]["total"]["overlapped_steps"] == 4


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(("param", "opt"), [("none", "none"), ("cpu", "cpu"), ("nvme", "cpu")])
def test_an_expert_never_routed_keeps_its_exact_values_in_low_precision(
    tmp_path: Any, dtype: str, param: str, opt: str
) -> None:
    # weight decay alone (lr 1e-2 x wd 0.1 per step) would move it if it were stepped with zeros
    case = CASES["moe"]
    model = build(case)
    with torch.no_grad():
        model.router.bias[7] = -1e4  # expert 7 never chosen
    init = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("experts.7.")}
    extra = {"fp16": {"initial_scale_power": 4}} if dtype == "fp16" else {}
    cfg = config(tmp_path, "moe", param, opt, dtype=dtype, **extra)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    with tiered.initialize(model, cfg) as engine:
        for b in make_batches("moe", 4, 4):
            engine.backward(engine(**b))
            engine.step()
        state = engine.zero.gather_full_state_dict()
        counts = engine.optimizer.param_step_counts()
        assert engine.global_steps == 4
    for n, t in init.items():
        assert torch.equal(state[n], t.to(torch_dtype)), n
        assert counts[n] == 0, n
    assert counts["head.weight"] == engine.optimizer.step_count > 0
    moved = [n for n in state if n.startswith("experts.") and not n.startswith("experts.7.")]
    assert any(
        not torch.equal(state[n], p.to(torch_dtype)) for n, p in build(case).named_parameters() if n in moved
    )


def test_per_parameter_step_counts_follow_use() -> None:
    case = CASES["aux"]
    with tiered.initialize(build(case), config(None, "aux")) as engine:
        for b in make_batches("aux", 3, 4, gas=2):
            engine.backward(engine(**b))
            engine.step()
        counts = engine.optimizer.param_step_counts()
    # aux used in windows 0 and 2 only
    assert counts["body.0.weight"] == counts["head.proj.bias"] == 3 and counts["head.aux"] == 2


# ---- parameter groups: ParamHyper --------------------------------------------------------------
def _no_decay(name: str) -> bool:
    return name.endswith(".bias") or name.startswith("body.1.")  # biases and the LayerNorm


def _with_param_hyper(monkeypatch: Any, hyper: dict[str, ParamHyper]) -> None:
    original = offload.OffloadedAdam.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, "param_hyper": hyper})

    monkeypatch.setattr(offload.OffloadedAdam, "__init__", init)


@pytest.mark.parametrize(
    ("param", "opt"), [("none", "none"), ("cpu", "cpu"), ("nvme", "none"), ("none", "nvme")]
)
def test_no_decay_param_group_equals_torch_two_param_groups(
    tmp_path: Any, monkeypatch: Any, param: str, opt: str
) -> None:
    names = [n for n, _ in build(CASES["aux"]).named_parameters()]
    _with_param_hyper(monkeypatch, {n: ParamHyper(weight_decay=0.0) for n in names if _no_decay(n)})
    run_pair("aux", config(tmp_path, "aux", param, opt), weight_decay=0.1, no_decay=_no_decay)


def test_no_decay_param_group_is_not_the_single_group(tmp_path: Any, monkeypatch: Any) -> None:
    # the two-group reference differs from the one-group one: the test above can fail
    case = CASES["aux"]
    batches = make_batches("aux", 4, 4, 2)
    _, two = reference_train(build(case), case, batches, gas=2, lr=1e-2, weight_decay=0.1, no_decay=_no_decay)
    _, one = reference_train(build(case), case, batches, gas=2, lr=1e-2, weight_decay=0.1)
    with pytest.raises(AssertionError):
        assert_params_close(one, two, REL)


def test_lr_scale_equals_a_param_group_with_its_own_lr(tmp_path: Any, monkeypatch: Any) -> None:
    case = CASES["moe"]
    batches = make_batches("moe", 3, 4)
    model = build(case)
    head = [p for n, p in model.named_parameters() if n.startswith("head.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    opt = torch.optim.AdamW(
        [{"params": rest}, {"params": head, "lr": 5e-3, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )
    for b in batches:
        model(**b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    _with_param_hyper(
        monkeypatch,
        {n: ParamHyper(weight_decay=0.0, lr_scale=0.5) for n in ("head.weight", "head.bias")},
    )
    _, got, _ = tiered_train(build(case), case, batches, config(tmp_path, "moe", "cpu", "cpu"))
    assert_params_close(got, want, REL)


def test_param_hyper_naming_no_parameter_is_refused(monkeypatch: Any) -> None:
    _with_param_hyper(monkeypatch, {"head.wieght": ParamHyper(weight_decay=0.0)})
    with pytest.raises(ValueError, match=r"head\.wieght"):
        tiered.initialize(build(CASES["moe"]), config(None, "moe"))


# ---- the kernels: one step count per tensor ----------------------------------------------------
def test_gpu_adam_step_takes_a_step_count_per_tensor() -> None:
    g = torch.Generator().manual_seed(0)
    shapes, steps = [5, 17, 3], [1, 4, 9]
    make = [[torch.randn(n, generator=g) for n in shapes] for _ in range(2)]
    params, grads = make
    m = [torch.rand(n, generator=g) for n in shapes]
    v = [torch.rand(n, generator=g) for n in shapes]
    want = [p.clone() for p in params]
    wm, wv = [t.clone() for t in m], [t.clone() for t in v]
    kw: dict[str, Any] = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for i, s in enumerate(steps):
        tiered_ext.adam_step_reference(want[i], grads[i], wm[i], wv[i], step=s, **kw)
    tiered_ext.gpu_adam_step(params, grads, m, v, step=steps, **kw)
    for i in range(3):
        torch.testing.assert_close(params[i], want[i], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v[i], wv[i], rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="one per tensor"):
        tiered_ext.gpu_adam_step(params, grads, m, v, step=[1, 2], **kw)
