"""2 gloo ranks whose graphs differ: rank 0's tokens go to experts {0, 1, 2} and rank 1's to
{2, 3} (expert 4 to none), a branch one rank takes, a weight one micro-batch of one rank uses.
With the leaf module declared (zero_optimization.leaf_module, DeepSpeed's key) training equals
plain torch.optim.AdamW with DDP's averaging; without it the ranks raise CollectiveOrderError
naming the module to declare, instead of hanging. Every launch fails (times out) on a hang.

Placements: the MoE case, the branch and the accumulation case in all 9 (params x optimizer), one
process pair per test; the whole model as leaf in a representative subset (none/none, cpu/nvme,
nvme/cpu)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from engine_support import REL, assert_losses_close, assert_params_close, build, ds_config, tiered_train
from leaf_support import CASES, GAS, LEAVES, SWITCH, ddp_reference, rank_batches, run_ranks, switch_batches

ALL = [(p, o) for p in ("none", "cpu", "nvme") for o in ("none", "cpu", "nvme")]
SUBSET = [("none", "none"), ("cpu", "nvme"), ("nvme", "cpu")]
LR, WD = 1e-2, 0.1


def _config(out_dir: str, name: str, param: str, opt: str, leaf: bool) -> dict[str, Any]:
    nvme = os.path.join(out_dir, f"nvme-{name}-{param}-{opt}")
    cfg = ds_config(param=param, opt=opt, nvme_path=nvme, gas=GAS[name], lr=LR, weight_decay=WD)
    if leaf:
        cfg["zero_optimization"]["leaf_module"] = LEAVES[name]
    return cfg


def _train(rank: int, jobs: list[tuple[str, str, str]], out_dir: str) -> dict[str, Any]:
    out = {}
    for name, param, opt in jobs:
        case = CASES[name]
        batches = rank_batches(name)[rank]
        losses, state, stats = tiered_train(
            build(case), case, batches, _config(out_dir, name, param, opt, True)
        )
        out[f"{name}/{param}/{opt}"] = {
            "losses": losses,
            "state": state,
            "checks": stats["zero"]["collective_checks"],
        }
    return out


_USED_BY_SOME = {"moe": "moe.experts.", "branch": "block.", "aux": "head.aux", "root": "experts."}


def _assert_ranks_diverge(name: str) -> None:
    # the ranks really use different parameters in the first window: else the test proves nothing
    case, used = CASES[name], []
    for mine in rank_batches(name):
        model = build(case)
        for b in mine[: GAS[name]]:
            model(**b).backward()
        used.append(
            {
                n
                for n, p in model.named_parameters()
                if p.grad is not None and n.startswith(_USED_BY_SOME[name])
            }
        )
    assert used[0] != used[1] and (used[0] or used[1]), (name, used)
    if name == "moe":
        assert not any(n.startswith("moe.experts.4.") for n in used[0] | used[1])


def _check(tmp_path: Path, jobs: list[tuple[str, str, str]]) -> None:
    for name in dict.fromkeys(n for n, _, _ in jobs):
        _assert_ranks_diverge(name)
    ranks = run_ranks(_train, tmp_path, jobs, str(tmp_path))
    for r in ranks:
        assert "error" not in r, r.get("error")
    for name in dict.fromkeys(n for n, _, _ in jobs):
        case = CASES[name]
        want_losses, want = ddp_reference(
            build(case), case, rank_batches(name), gas=GAS[name], lr=LR, weight_decay=WD
        )
        for name_, param, opt in jobs:
            if name_ != name:
                continue
            for r, got in enumerate(ranks):
                run = got[f"{name}/{param}/{opt}"]
                assert_params_close(run["state"], want, REL)
                assert_losses_close(run["losses"], want_losses[r])
                assert run["checks"] > 0  # the ranks did agree on every collective


def test_moe_with_divergent_routing_in_every_placement(tmp_path: Path) -> None:
    _check(tmp_path, [("moe", p, o) for p, o in ALL])


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_branch_accumulation_and_the_model_as_leaf(tmp_path: Path) -> None:
    # one process pair for the three cases (a launch costs seconds)
    jobs = [(name, p, o) for name in ("branch", "aux") for p, o in ALL]
    _check(tmp_path, jobs + [("root", p, o) for p, o in SUBSET])


def _undeclared(rank: int, out_dir: str) -> dict[str, Any]:
    import tiered

    case = CASES["moe"]
    try:
        tiered_train(
            build(case), case, rank_batches("moe")[rank], _config(out_dir, "moe", "cpu", "cpu", False)
        )
    except tiered.CollectiveOrderError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def test_divergent_ranks_without_a_leaf_raise_naming_the_module(tmp_path: Path) -> None:
    ranks = run_ranks(_undeclared, tmp_path, str(tmp_path), timeout_s=120)
    for r in ranks:
        assert "error" not in r, r.get("error")
        msg = r["raised"]
        assert msg is not None, "the ranks trained on although their collectives diverge"
        assert "rank 0 gathers group" in msg and "moe.experts.0" in msg and "moe.experts.2" in msg, msg
        assert '"leaf_module": {"classes": ["SparseMoE"]}' in msg and '"names": ["moe"]' in msg, msg


def _switch(rank: int, jobs: list[tuple[str, str, str | None]], out_dir: str) -> dict[str, Any]:
    import tiered

    out: dict[str, Any] = {}
    for param, opt, leaf in jobs:
        nvme = os.path.join(out_dir, f"nvme-switch-{param}-{opt}-{leaf}")
        cfg = ds_config(param=param, opt=opt, nvme_path=nvme, lr=LR, weight_decay=WD)
        cfg["zero_optimization"]["leaf_module"] = {"classes": [] if leaf is None else [leaf]}
        try:
            losses, state, stats = tiered_train(build(SWITCH), SWITCH, switch_batches()[rank], cfg)
        except tiered.CollectiveOrderError as exc:
            out[f"{param}/{opt}/{leaf}"] = {"raised": str(exc)}
            continue
        out[f"{param}/{opt}/{leaf}"] = {
            "losses": losses,
            "state": state,
            "leaves": stats["zero"]["leaf_modules"],
        }
    return out


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_hugging_face_switch_transformer_with_divergent_routing(tmp_path: Path) -> None:
    # an HF MoE whose experts are modules of their own (an nn.ModuleDict): without a leaf the
    # error names the module to declare; declared (the error's advice or the MoE block), exact
    batches = switch_batches()
    used = []
    for mine in batches:  # the ranks' tokens reach different experts (else this proves nothing)
        model = build(SWITCH)
        SWITCH.loss(model(**mine[0])).backward()
        used.append({n for n, p in model.named_parameters() if ".experts." in n and p.grad is not None})
    assert used[0] != used[1]
    want_losses, want = ddp_reference(build(SWITCH), SWITCH, batches, gas=1, lr=LR, weight_decay=WD)
    jobs = [
        ("cpu", "cpu", None),
        ("none", "none", "SwitchTransformersExperts"),
        ("nvme", "cpu", "SwitchTransformersSparseMLP"),
    ]
    ranks = run_ranks(_switch, tmp_path, jobs, str(tmp_path))
    for r, got in enumerate(ranks):
        assert "error" not in got, got.get("error")
        assert '"classes": ["SwitchTransformersExperts"]' in got["cpu/cpu/None"]["raised"]
        for param, opt, leaf in jobs[1:]:
            run = got[f"{param}/{opt}/{leaf}"]
            assert run["leaves"] == 4  # one per sparse layer
            assert_params_close(run["state"], want, REL)
            assert_losses_close(run["losses"], want_losses[r])
