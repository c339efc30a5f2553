"""The gradient norm for clipping is torch.nn.utils.clip_grad_norm_'s, bit for bit on one rank
([Note: gradient norm as torch's] in tiered/zero/coordinator.py), and the demo's full run stays
within torch's own implementation spread of plain PyTorch."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import CASES, build, ds_config, make_batches


def _first_step_norms(case_name: str, config: dict[str, Any], micro: int) -> tuple[float, float]:
    """(engine.last_grad_norm, clip_grad_norm_'s total norm) after one step on the same batch."""
    import tiered

    case = CASES[case_name]
    (batch,) = make_batches(case, 1, micro)
    model = build(case)
    reference = copy.deepcopy(model)
    with tiered.initialize(model, config) as engine:
        engine.backward(case.loss(engine(**batch)))
        engine.step()
        got = float(engine.last_grad_norm)
    case.loss(reference(**batch)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0))
    return got, want


@pytest.mark.parametrize(("param", "opt", "grad_tier"), [("none", "none", None), ("nvme", "nvme", "nvme")])
def test_grad_norm_is_clip_grad_norms_bitwise(
    tmp_path: Path, param: str, opt: str, grad_tier: str | None
) -> None:
    # torch's fp32 norm is not the exact one (on the demo up to 1e-5 relative off it); the engine's must be
    # torch's, not closer to the truth: Adam carries the clip coefficient into later steps
    cfg = ds_config(param=param, opt=opt, nvme_path=str(tmp_path / "nvme"), clip=1.0, sub_group_size=20000)
    if grad_tier is not None:
        cfg.setdefault("tiered", {})["grad_tier"] = grad_tier
    got, want = _first_step_norms("llama", cfg, micro=8)
    assert got == want, f"engine norm {got!r} != clip_grad_norm_ {want!r} (rel {abs(got - want) / want:.2e})"


@pytest.mark.slow
def test_full_demo_within_torchs_own_spread(tmp_path: Path) -> None:
    # The demo's 20 steps (ZeRO-3, params and optimizer on NVMe, clipping 1.0): with the exact
    # norm the run ended 1.35e-4 from plain PyTorch; torch's fused and foreach AdamW end 1.30e-5
    # apart on it. Bound: twice torch's own spread, which the demo's 1e-4 contains.
    from tiered.cli import demo_finetune

    out = io.StringIO()
    assert demo_finetune.run_demo(False, tmp_path, out) == 0, out.getvalue()
    line = next(x for x in out.getvalue().splitlines() if x.startswith("max relative parameter difference"))
    diff = float(line.split(":")[1].split()[0])
    assert diff <= 2.6e-5, line
