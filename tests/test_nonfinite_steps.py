"""[Note: non-finite steps]: a NaN/inf loss or gradient (bf16, fp32) never reaches the weights
silently. By default the step raises `NonFiniteError` naming the step, what was not finite and
the key; ``tiered.nonfinite_step: "skip"`` skips it with a WARNING and a counter; ``"apply"``
is plain PyTorch (the exact oracle). A loss the engine did not compute is refused, not counted."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_support import CASES, build, ds_config, make_batches
from torch import nn

import tiered
from tiered.config.dump import dump_config
from tiered.config.loader import load_config
from tiered.errors import ConfigError, NonFiniteError

Batch = dict[str, torch.Tensor]


class Masked(nn.Module):
    """A finite loss whose gradient is NaN when `x` holds inf where `keep` is False: the inf is
    masked out of the forward (torch.where) but inf * 0 = NaN reaches `a.weight`'s gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.where(keep, h, torch.zeros_like(h))
        return F.mse_loss(self.b(h), y)


def _masked_batches(n: int, dtype: torch.dtype) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        keep = torch.ones(4, 8, dtype=torch.bool)
        keep[0] = False
        out.append(
            {
                "x": torch.randn(4, 8, generator=g).to(dtype),
                "keep": keep,
                "y": torch.randn(4, 4, generator=g).to(dtype),
            }
        )
    return out


def _poison(b: Batch, where: str) -> Batch:
    b = {k: v.clone() for k, v in b.items()}
    b["x"][0, 0] = float("inf") if where == "grad" else float("nan")
    return b


def _cfg(dtype: str, policy: str | None, clip: float = 0.0, gas: int = 1, **kw: Any) -> dict[str, Any]:
    cfg = ds_config(dtype=dtype, clip=clip, gas=gas, param="cpu", opt="cpu", **kw)
    if policy is not None:
        cfg.setdefault("tiered", {})["nonfinite_step"] = policy
    return cfg


def _batches(where: str, dtype: str, n: int = 3) -> tuple[nn.Module, list[Batch]]:
    td = torch.bfloat16 if dtype == "bf16" else torch.float32
    if where == "grad":
        torch.manual_seed(0)
        return Masked(), _masked_batches(n, td)
    bs = [{k: v.to(td) for k, v in b.items()} for b in make_batches(CASES["mlp"], n, 4)]
    return build(CASES["mlp"]), bs


def _train(
    model: nn.Module, cfg: dict[str, Any], batches: list[Batch]
) -> tuple[Any, dict[str, torch.Tensor]]:
    engine = tiered.initialize(model, cfg)
    try:
        for b in batches:
            engine.backward(engine(**b))
            engine.step()
        return engine, {k: v.clone() for k, v in engine.state_dict_fp32().items()}
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("where", ["loss", "grad"])
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip"])
def test_the_default_raises_naming_the_step_what_and_the_key(dtype: str, where: str, clip: float) -> None:
    model, bs = _batches(where, dtype)
    engine = tiered.initialize(model, _cfg(dtype, None, clip=clip))
    with engine:
        engine.backward(engine(**bs[0]))
        engine.step()
        before = {k: v.clone() for k, v in engine.state_dict_fp32().items()}
        loss = engine(**_poison(bs[1], where))
        assert torch.isfinite(loss) == (where == "grad")  # the masked case: only the gradient is NaN
        engine.backward(loss)
        with pytest.raises(NonFiniteError) as info:
            engine.step()
        msg = str(info.value)
        assert "optimizer step 2" in msg and "tiered.nonfinite_step" in msg and '"skip"' in msg, msg
        assert ("the loss of micro-batch 1" in msg) == (where == "loss"), msg
        if where == "grad":
            assert "the gradient of group" in msg, msg
        after = engine.state_dict_fp32()
        for k, v in before.items():  # nothing of the step reached the weights
            assert torch.equal(after[k], v), k
        # the window was dropped: the engine trains on from clean state
        engine.backward(engine(**bs[2]))
        engine.step()
        assert all(torch.isfinite(v).all() for v in engine.state_dict_fp32().values())
        assert engine.optimizer.step_count == 2 and engine.skipped_steps == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("where", ["loss", "grad"])
def test_skip_warns_counts_and_leaves_no_trace(
    dtype: str, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, bs = _batches(where, dtype)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="tiered"):
        engine, got = _train(model, _cfg(dtype, "skip"), [bs[0], _poison(bs[1], where), bs[2]])
    assert "optimizer step 2" in caplog.text and "step skipped" in caplog.text
    st = engine.stats()
    assert st["nonfinite_steps"] == 1 and st["skipped_steps"] == 1 and st["global_steps"] == 3
    # bitwise the run that never saw the bad batch
    again = Masked() if where == "grad" else build(CASES["mlp"])
    again.load_state_dict(fresh)
    _, want = _train(again, _cfg(dtype, "skip"), [bs[0], bs[2]])
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_apply_is_plain_pytorch_the_weights_take_the_nan(where: str) -> None:
    model, bs = _batches(where, "fp32")
    _, got = _train(model, _cfg("fp32", "apply"), [bs[0], _poison(bs[1], where)])
    assert any(not torch.isfinite(v).all() for v in got.values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_check_changes_no_bit_of_a_finite_run(dtype: str) -> None:
    """The oracle mode ("apply", nothing checked) and the default train bitwise alike."""
    _, bs = _batches("loss", dtype, n=4)
    _, guarded = _train(build(CASES["mlp"]), _cfg(dtype, None, gas=2), bs)
    _, oracle = _train(build(CASES["mlp"]), _cfg(dtype, "apply", gas=2), bs)
    for k, v in oracle.items():
        assert torch.equal(guarded[k], v), k


def test_a_bad_micro_batch_inside_an_accumulation_window_is_named() -> None:
    _, bs = _batches("loss", "fp32", n=2)
    with tiered.initialize(build(CASES["mlp"]), _cfg("fp32", None, gas=2)) as engine:
        engine.backward(engine(**_poison(bs[0], "loss")))
        engine.step()  # not the boundary: nothing decided yet
        engine.backward(engine(**bs[1]))
        with pytest.raises(NonFiniteError, match=r"step 1: the loss of micro-batch 1 \(nan\)"):
            engine.step()


def test_an_empty_selection_nan_loss_raises() -> None:
    """Every label ignored: cross-entropy is 0/0 = NaN, as with an empty batch."""
    model = nn.Linear(4, 3)
    with tiered.initialize(model, _cfg("fp32", None)) as engine:
        logits = engine(torch.randn(2, 4))
        engine.backward(F.cross_entropy(logits, torch.full((2,), -100)))
        with pytest.raises(NonFiniteError, match="the loss of micro-batch 1"):
            engine.step()


def test_overlap_step_checks_the_loss_before_it_begins_and_raises_on_a_late_gradient() -> None:
    _, bs = _batches("loss", "fp32")
    cfg = _cfg("fp32", "skip")
    cfg["tiered"]["overlap_step_with_backward"] = True
    with tiered.initialize(build(CASES["mlp"]), cfg) as engine:
        engine.backward(engine(**bs[0]))
        engine.step()
        before = {k: v.clone() for k, v in engine.state_dict_fp32().items()}
        engine.backward(engine(**_poison(bs[1], "loss")))
        engine.step()  # skipped: the loss was looked at before the overlapped step began
        assert engine.stats()["nonfinite_steps"] == 1
        for k, v in engine.state_dict_fp32().items():
            assert torch.equal(v, before[k]), k
    model, mb = _batches("grad", "fp32")
    with tiered.initialize(model, cfg) as engine:
        engine.backward(engine(**_poison(mb[0], "grad")))
        with pytest.raises(NonFiniteError, match="had already begun"):
            engine.step()


def test_nonfinite_step_key_values_round_trip_and_fp16_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"tiered.nonfinite_step = 'ignore'.*'raise', 'skip', 'apply'"):
        load_config(_cfg("fp32", "ignore"))
    cfg = load_config(_cfg("bf16", "skip"))
    assert cfg.tiered.nonfinite_step == "skip"
    assert load_config(dump_config(cfg)).tiered.nonfinite_step == "skip"
    with pytest.raises(ConfigError, match=r"tiered.nonfinite_step = 'skip' with fp16.*loss scaler"):
        tiered.initialize(build(CASES["mlp"]), _cfg("fp16", "skip"))


def test_a_loss_the_engine_did_not_compute_is_refused_and_not_counted() -> None:
    case = CASES["mlp"]
    b = make_batches(case, 1, 4)[0]
    with tiered.initialize(build(case), _cfg("fp32", None)) as engine:
        stranger = nn.Linear(16, 1)
        with pytest.raises(ValueError, match=r"no parameter the engine trains got a gradient"):
            engine.backward(stranger(b["x"]).sum())
        assert engine.micro_steps == 0
        with pytest.raises(RuntimeError, match="without engine.backward"):
            engine.step()  # the refused backward did not count
        engine.backward(engine(**b))
        engine.step()
        assert engine.global_steps == 1 and engine.optimizer.step_count == 1


def test_lr_1e30_is_not_exit_0_from_finetune(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from test_finetune import TEXT, TINY, cli
    from test_finetune import ds_config as ft_config

    from tiered.cli.main import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(ft_config(tmp_path / "nvme")))
    files = {"model": model, "data": tmp_path / "corpus.txt", "config": cfg, "tmp": tmp_path}
    assert main(cli(files, "--lr", "1e30")) == 2
    err = capsys.readouterr().err
    assert "is not finite" in err and "tiered.nonfinite_step" in err, err


def test_gradients_homed_on_nvme_are_checked_from_their_kept_norm(tmp_path: Any) -> None:
    """[Note: gradients on nvme]: the squared norm kept per flush names the group; nothing is
    read back from storage for the check."""
    model, mb = _batches("grad", "fp32")
    cfg = ds_config(opt="nvme", param="cpu", nvme_path=str(tmp_path / "nvme"))
    cfg["tiered"] = {"grad_tier": "nvme"}
    with tiered.initialize(model, cfg) as engine:
        engine.backward(engine(**mb[0]))
        engine.step()
        engine.backward(engine(**_poison(mb[1], "grad")))
        with pytest.raises(NonFiniteError, match=r"step 2: the gradient of group"):
            engine.step()


def test_skip_on_every_step_is_not_exit_0_from_finetune(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`"skip"` over a run whose every step is non-finite (a checkpoint whose final norm overflows the logits)
    learnt nothing: the run says so and exits non-zero, never 0."""
    import json

    from test_finetune import TEXT, TINY, cli
    from test_finetune import ds_config as ft_config
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiered.cli.main import main

    model = tmp_path / "model"
    broken = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"}))
    with torch.no_grad():
        broken.model.norm.weight.fill_(3e38)  # finite, but the logits overflow
    broken.save_pretrained(model, safe_serialization=True)
    (tmp_path / "corpus.txt").write_text(TEXT)
    raw = ft_config(tmp_path / "nvme")
    raw["tiered"] = {"nonfinite_step": "skip"}
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(raw))
    files = {"model": model, "data": tmp_path / "corpus.txt", "config": cfg, "tmp": tmp_path}
    assert main(cli(files)) == 3
    err = capsys.readouterr().err
    assert "3 of 3 optimizer steps were skipped" in err and "no optimizer step was applied" in err, err


def test_deepspeeds_bf16_check_grad_overflow_skips_the_step(caplog: pytest.LogCaptureFixture) -> None:
    """`bf16.check_grad_overflow: true` (DeepSpeed's switch to skip a bf16 step whose gradients
    overflowed) was refused as if tiered had no such check: it is `tiered.nonfinite_step`
    "skip"; where that key is set it wins; and a `"bf16": null` section is absent, as in
    DeepSpeed (it was refused)."""
    model, bs = _batches("grad", "bf16")
    cfg = _cfg("bf16", None)
    cfg["bf16"]["check_grad_overflow"] = True
    with caplog.at_level(logging.WARNING, logger="tiered"):
        engine, _ = _train(model, cfg, [bs[0], _poison(bs[1], "grad"), bs[2]])
    assert "step skipped" in caplog.text and engine.stats()["nonfinite_steps"] == 1
    explicit = _cfg("bf16", "raise")
    explicit["bf16"]["check_grad_overflow"] = True
    model, bs = _batches("grad", "bf16")
    with pytest.raises(NonFiniteError):
        _train(model, explicit, [bs[0], _poison(bs[1], "grad")])
    assert load_config({**_cfg("fp32", None), "bf16": None}).precision.dtype == torch.float32
    assert load_config({**_cfg("fp32", None), "bfloat16": None}).precision.dtype == torch.float32
