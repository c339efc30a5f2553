"""The DeepSpeed surface of ported scripts on tiered's engine: every call of the probe list
(tests/deepspeed_probe.py) works and returns what DeepSpeed 0.19.8's CPU engine returned for the
same model, JSON and data (recorded in tests/data/deepspeed_probe_values.json), and the
behaviours behind them: checkpoint keywords, client_state tensors, the config scheduler's object,
the engine as a module, zero.Init, the safe getters."""

from __future__ import annotations

import json
import math
from typing import Any

import deepspeed_probe as probe
import pytest
import torch
import torch.nn as nn
from engine_support import MLP, ds_config, no_leftover_process_group  # noqa: F401 - the fixture

import tiered.deepspeed as deepspeed
from tiered.errors import UnsupportedConfigError

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Where `a` and `b` (normalised probe values) differ; floats to 2e-5 absolute + 1e-5 relative."""
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return [] if math.isclose(a, b, rel_tol=1e-5, abs_tol=2e-5) else [f"{path}: {a} != {b}"]
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}[{i}]")]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}.{k}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_every_probe_call_works_and_returns_deepspeeds_value(tmp_path: Any) -> None:
    recorded = json.loads(probe.VALUES.read_text())
    assert recorded["deepspeed"] == deepspeed.__version__
    theirs = recorded["results"]
    ours = probe.run_probes(deepspeed, str(tmp_path))
    assert len(ours) >= 79
    broken = {n: r["error"] for n, r in ours.items() if not r["ok"]}
    assert not broken, broken
    diffs = []
    for name, r in ours.items():
        if probe.kind_of(name) != "value":
            continue
        assert theirs[name]["ok"], f"DeepSpeed failed {name}: {theirs[name].get('error')}"
        diffs += same(r["value"], theirs[name]["value"], name)
    assert not diffs, diffs


def _engine(**kw: Any) -> Any:
    torch.manual_seed(0)
    model = MLP()
    return deepspeed.initialize(model=model, config=ds_config(param="cpu", opt="cpu", **kw)), model


def _train(engine: Any, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + i)
        engine.backward(engine(x=torch.randn(4, 16, generator=g), y=torch.randn(4, 8, generator=g)))
        engine.step()


def test_checkpoint_keywords(tmp_path: Any) -> None:
    (engine, *_), model = _engine()
    with engine:
        _train(engine, 2)
        engine.save_checkpoint(
            tmp_path, tag="a", client_state={"ids": torch.arange(4), "n": [1, torch.ones(2)]}
        )
        w = deepspeed.utils.safe_get_full_fp32_param(model.inp.weight)
        m = deepspeed.utils.safe_get_full_optimizer_state(model.inp.weight, "exp_avg")
        _train(engine, 2, seed=10)
        # weights only: moments and counters stay those of step 4
        m4 = deepspeed.utils.safe_get_full_optimizer_state(model.inp.weight, "exp_avg")
        _, state = engine.load_checkpoint(tmp_path, tag="a", load_module_only=True)
        assert torch.equal(state["ids"], torch.arange(4)) and torch.equal(state["n"][1], torch.ones(2))
        assert engine.global_steps == 4
        torch.testing.assert_close(
            deepspeed.utils.safe_get_full_fp32_param(model.inp.weight), w, atol=0, rtol=0
        )
        torch.testing.assert_close(
            deepspeed.utils.safe_get_full_optimizer_state(model.inp.weight, "exp_avg"), m4, atol=0, rtol=0
        )
        engine.load_checkpoint(tmp_path, tag="a", load_optimizer_states=False)
        assert engine.global_steps == 2  # the counters come back, the moments do not
        assert not torch.equal(deepspeed.utils.safe_get_full_optimizer_state(model.inp.weight, "exp_avg"), m)
        engine.load_checkpoint(tmp_path, tag="a")
        torch.testing.assert_close(
            deepspeed.utils.safe_get_full_optimizer_state(model.inp.weight, "exp_avg"), m, atol=0, rtol=0
        )
        with pytest.raises(UnsupportedConfigError, match="custom_load_fn"):
            engine.load_checkpoint(tmp_path, tag="a", custom_load_fn=lambda *a: None)
        with pytest.raises(UnsupportedConfigError, match="load_module_strict"):
            engine.load_checkpoint(tmp_path, tag="a", load_module_strict=False)
        with pytest.raises(ValueError, match="JSON"):
            engine.save_checkpoint(tmp_path, tag="b", client_state={"obj": object()})


def test_a_config_schedule_refuses_loading_the_optimizer_without_the_scheduler(tmp_path: Any) -> None:
    sched = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}}
    (engine, _, _, lr_scheduler), _ = _engine(scheduler=sched)
    with engine:
        _train(engine, 1)
        engine.save_checkpoint(tmp_path, tag="a")
        with pytest.raises(UnsupportedConfigError, match="load_lr_scheduler_states=False"):
            engine.load_checkpoint(tmp_path, tag="a", load_lr_scheduler_states=False)
        with pytest.raises(RuntimeError, match="engine.step"):
            lr_scheduler.step()
        assert lr_scheduler.get_last_lr() == engine.get_lr() and lr_scheduler.last_batch_iteration == 0


def test_exclude_frozen_parameters_keeps_the_engines_frozen_values(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = MLP()
    model.inp.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(param="cpu", opt="cpu"))
    with engine:
        _train(engine, 1)
        engine.save_checkpoint(tmp_path, tag="a", exclude_frozen_parameters=True)
        before = engine.state_dict()
        with deepspeed.zero.GatheredParameters(model.inp.weight, modifier_rank=0):
            with torch.no_grad():
                model.inp.weight.fill_(3.0)
        engine.load_checkpoint(tmp_path, tag="a")
        after = engine.state_dict()
    assert torch.all(after["module.inp.weight"] == 3.0)  # not in the checkpoint: left as it is
    torch.testing.assert_close(after["module.out.weight"], before["module.out.weight"], atol=0, rtol=0)


def test_the_engine_as_a_module(tmp_path: Any) -> None:
    (engine, *_), model = _engine()
    ref = MLP()
    with engine:
        assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in ref.named_parameters()]
        assert len(list(engine.parameters())) == len(list(model.parameters()))
        sd = engine.state_dict()
        assert sorted(sd) == sorted(f"module.{k}" for k in ref.state_dict())
        _train(engine, 2)
        trained = engine.state_dict()
        assert not torch.equal(trained["module.inp.weight"], sd["module.inp.weight"])
        engine.load_state_dict(sd)  # back to the start, in the partitions and the fp32 master
        restored = engine.state_dict()
        master = deepspeed.utils.safe_get_full_fp32_param(model.inp.weight)
        assert engine.inp is model.inp  # a model attribute, through the engine
        with pytest.raises(AttributeError):
            engine.no_such_attribute  # noqa: B018
        path = engine.save_16bit_model(tmp_path, "pytorch_model.bin")
        saved = torch.load(path, weights_only=True)
    for k in sd:
        torch.testing.assert_close(restored[k], sd[k], atol=0, rtol=0)
    torch.testing.assert_close(master, sd["module.inp.weight"], atol=0, rtol=0)
    assert set(saved) == set(model.state_dict()) and saved["inp.weight"].dtype == torch.float32


def test_safe_setters_reach_the_next_forward() -> None:
    (engine, *_), model = _engine()
    with engine:
        new = torch.full((8,), 2.0)
        deepspeed.utils.safe_set_full_fp32_param(model.out.bias, new)
        assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(model.out.bias), new)
        assert torch.equal(engine.state_dict()["module.out.bias"], new)
        assert deepspeed.utils.safe_get_full_fp32_param(nn.Linear(2, 2).weight) is None  # not managed
        with pytest.raises(KeyError, match="exp_avg"):
            deepspeed.utils.safe_get_full_optimizer_state(model.out.bias, "momentum_buffer")


def test_zero_init_builds_on_meta_and_initialize_partitions() -> None:
    with deepspeed.zero.Init(config_dict_or_path=ds_config(param="cpu", opt="cpu")):
        model = MLP()
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(Exception, match="initialize first"):
        deepspeed.zero.GatheredParameters(model.inp.weight)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(param="cpu", opt="cpu"))
    with engine:
        _train(engine, 1)
        w = deepspeed.utils.safe_get_full_fp32_param(model.inp.weight)
        assert w is not None and w.shape == (48, 16) and torch.isfinite(w).all() and w.std() > 0
    with pytest.raises(Exception, match="stage"):
        deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 2}})
    with pytest.raises(UnsupportedConfigError, match="remote_device"):
        deepspeed.zero.Init(remote_device="nvme")


def test_one_process_gets_a_process_group_and_deepspeeds_sampler() -> None:
    data = [(torch.full((16,), float(i)), torch.zeros(8)) for i in range(12)]
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    engine, _, loader, _ = deepspeed.initialize(
        model=MLP(), config=ds_config(param="cpu", opt="cpu"), training_data=data
    )
    with engine:
        assert torch.distributed.get_world_size() == 1 and deepspeed.comm.get_rank() == 0
        order = [int(x[0]) for xb, _ in loader for x in xb]
        again = [int(x[0]) for xb, _ in loader for x in xb]
    # DistributedSampler's seed-0 permutation of 12 (DeepSpeed's loader; it never calls set_epoch)
    assert order == again == torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()


def test_add_config_arguments_and_the_accelerator_without_deepspeed() -> None:
    import argparse

    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed_config", "c.json"]
    )
    assert args.deepspeed_config == "c.json" and args.deepspeed is False
    acc = deepspeed.accelerator.get_accelerator()
    assert acc.device_name() == ("cuda" if torch.cuda.is_available() else "cpu") and acc.is_available()


def test_safe_get_full_grad_is_torchs_gradient_inside_the_window() -> None:
    """gradient_accumulation_steps 2: after one backward the accumulated gradient is that of
    loss / 2, as plain PyTorch computes it; after the window's step it is zero."""
    torch.manual_seed(0)
    ref = MLP()
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    (ref(x=x, y=y) / 2).backward()
    (engine, *_), model = _engine(gas=2)
    with engine:
        engine.backward(engine(x=x, y=y))
        for n, p in ref.named_parameters():
            got = deepspeed.utils.safe_get_full_grad(dict(model.named_parameters())[n])
            torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=1e-5)
        engine.step()
        engine.backward(engine(x=x, y=y))
        engine.step()
        assert torch.count_nonzero(deepspeed.utils.safe_get_full_grad(model.inp.weight)) == 0
