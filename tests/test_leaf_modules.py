"""Leaf modules on one process: DeepSpeed's zero_optimization.leaf_module key (classes, names,
name suffixes, its default classes) and set_leaf_modules, which modules they select and refuse,
how a leaf's parameters are grouped, and training with leaves equal to torch.optim.AdamW
(the boundary flush, and the model itself as a leaf flushed at the end of backward)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import (
    REL,
    Case,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    reference_train,
    tiered_train,
)
from leaf_support import CASES, GAS, LEAVES, MoENet, rank_batches
from torch import nn

import tiered
from tiered.config import load_config
from tiered.config.dump import dump_config
from tiered.config.schema import DEFAULT_LEAF_CLASSES, LeafModuleConfig
from tiered.errors import ConfigError
from tiered.zero import set_leaf_modules
from tiered.zero.leaf import find_leaf_modules
from tiered.zero.plan import plan_param_groups

ZP = "zero_optimization"


def _leaves(model: nn.Module, **cfg: Any) -> list[str]:
    return find_leaf_modules(model, load_config({ZP: {"stage": 3, "leaf_module": cfg}}).zero.leaf_module)


def test_the_key_reads_as_deepspeed_reads_it() -> None:
    z = load_config({ZP: {"stage": 3}}).zero
    assert (
        z.leaf_module.classes == DEFAULT_LEAF_CLASSES and "MixtralSparseMoeBlock" in z.leaf_module.classes[0]
    )
    cfg = load_config(
        {ZP: {"stage": 3, "leaf_module": {"classes": "SparseMoE", "name_suffixes": ["moe", "moe"]}}}
    )
    assert cfg.zero.leaf_module == LeafModuleConfig(classes=("SparseMoE",), name_suffixes=("moe",))
    assert load_config(dump_config(cfg)) == cfg
    assert load_config({ZP: {"stage": 3, "leaf_module": {"classes": []}}}).zero.leaf_module.classes == ()
    with pytest.raises(
        ConfigError, match=r"zero_optimization\.leaf_module\.names: expected a list of strings"
    ):
        load_config({ZP: {"stage": 3, "leaf_module": {"names": [1]}}})
    with pytest.raises(ConfigError, match=r"name_suffixes: .*empty entry"):
        load_config({ZP: {"stage": 3, "leaf_module": {"name_suffixes": [""]}}})
    with pytest.raises(ConfigError, match=r"'zero_optimization\.leaf_module\.class'; did you mean .*classes"):
        load_config({ZP: {"stage": 3, "leaf_module": {"class": ["X"]}}})
    assert load_config({"tiered": {"check_collective_order": False}}).tiered.check_collective_order is False
    with pytest.raises(ConfigError, match=r"tiered\.check_collective_order: expected true or false"):
        load_config({"tiered": {"check_collective_order": "no"}})


def test_which_modules_are_leaves() -> None:
    m = MoENet()
    assert _leaves(m, classes=["SparseMoE"]) == ["moe"]
    assert _leaves(m, classes=["leaf_support.SparseMoE"]) == ["moe"]
    assert _leaves(m, names=["moe"]) == ["moe"]
    assert _leaves(m, name_suffixes=["oe"]) == ["moe"]
    assert _leaves(m, names=["moe.experts.1", "moe"]) == ["moe"]  # a leaf inside a leaf is part of it
    assert _leaves(m, names=["", "moe"]) == [""]
    assert _leaves(m) == []  # DeepSpeed's default classes: none in this model, and no error
    with pytest.raises(ConfigError, match=r"classes: 'Nope' matches no module of MoENet"):
        _leaves(m, classes=["Nope"])
    with pytest.raises(ConfigError, match=r"names: no module named 'moe.expert'"):
        _leaves(m, names=["moe.expert"])
    with pytest.raises(ConfigError, match=r"name_suffixes: no module name of MoENet ends in 'xyz'"):
        _leaves(m, name_suffixes=["xyz"])
    with pytest.raises(
        ConfigError, match=r"'moe\.experts' \(ModuleList\) a leaf .*never called.*'moe' \(SparseMoE\)"
    ):
        _leaves(m, name_suffixes=["experts"])
    assert set_leaf_modules(m, [type(m.moe)]) == [m.moe]
    assert _leaves(m, classes=[]) == ["moe"]  # DeepSpeed's flag, set by set_leaf_modules
    with pytest.raises(ValueError, match="no module of"):
        set_leaf_modules(m, ["Nope"])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.moe = MoENet().moe
        self.norm = nn.LayerNorm(8)


class _Blocks(nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))


def test_a_leaf_owns_its_groups_inside_a_block_and_beside_persistent_ones() -> None:
    model = _Blocks()
    planned = plan_param_groups(
        model,
        sub_group_size_numel=700,
        param_persistence_threshold_numel=10_000,  # everything small enough to be persistent
        model_persistence_threshold_numel=10**9,
        leaves=["layers.0.moe"],
    )
    names = [[q for q, _ in pg.params] for pg in planned]
    leaf = [pg for pg in planned if pg.leaf == "layers.0.moe"]
    assert len(leaf) > 1 and all(not pg.persistent for pg in leaf)  # split above the cap, never persistent
    assert [q for pg in leaf for q, _ in pg.params] == [
        f"layers.0.moe.{n}" for n, _ in model.layers[0].moe.named_parameters()
    ]
    others = [q for pg in planned if pg.leaf is None for q, _ in pg.params]
    assert not any(q.startswith("layers.0.moe.") for q in others)
    assert any(q.startswith("layers.1.moe.") for q in others)  # not a leaf: planned as before
    assert sum(len(n) for n in names) == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("name", "param", "opt"), [("moe", "none", "none"), ("moe", "nvme", "cpu"), ("root", "cpu", "nvme")]
)
def test_training_with_a_leaf_equals_torch(tmp_path: Path, name: str, param: str, opt: str) -> None:
    case, gas = CASES[name], GAS[name]
    batches = rank_batches(name)[0]  # one rank's data: experts {0, 1, 2}, {3}, {1, 2, 3}
    want_losses, want = reference_train(build(case), case, batches, gas=gas, lr=1e-2, weight_decay=0.1)
    cfg = ds_config(
        param=param, opt=opt, nvme_path=str(tmp_path / "nvme"), gas=gas, lr=1e-2, weight_decay=0.1
    )
    cfg[ZP]["leaf_module"] = LEAVES[name]
    got_losses, got, stats = tiered_train(build(case), case, batches, cfg)
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)
    assert stats["zero"]["leaf_modules"] == 1


def test_a_leaf_gathers_its_subtree_on_entry_and_flushes_it_at_its_boundary() -> None:
    model = MoENet()
    cfg = ds_config(param="cpu", opt="cpu", lr=1e-2)
    cfg[ZP]["leaf_module"] = {"names": ["moe"]}
    with tiered.initialize(model, cfg) as engine:
        zp = engine.zero
        flushed: list[int] = []
        zp.on_group_grads_complete(lambda g: flushed.append(g.index))
        leaf = sorted({zp.managed[id(p)][0] for p in model.moe.parameters()})
        pinned: list[list[int]] = []
        model.moe.experts[0].register_forward_pre_hook(
            lambda *_: pinned.append([i for i in leaf if zp.runtimes[i].pins > 0])
        )
        engine.backward(engine(**rank_batches("moe")[0][0]))  # experts 0, 1, 2 only
        assert pinned == [leaf]  # entering moe gathered every expert, the idle 3 and 4 included
        # every group of the leaf flushed together (the idle experts' with zeros), in index order
        assert [i for i in flushed if i in leaf] == leaf
        assert flushed.index(leaf[0]) + len(leaf) - 1 == flushed.index(leaf[-1])
        received = {e.name: bool(zp.received_local(g)[j]) for g in zp.groups for j, e in enumerate(g.entries)}
        assert received["moe.experts.2.0.weight"] and not received["moe.experts.3.0.weight"]
        engine.step()


def test_a_frozen_leaf_stays_gathered_through_its_backward() -> None:
    # frozen groups are normally released two gathers later (re-gathered on demand): inside a
    # leaf that re-gather would be a collective only the ranks using that expert issue
    model = MoENet()
    for p in model.moe.experts.parameters():
        p.requires_grad_(False)
    cfg = ds_config(param="cpu", opt="cpu", lr=1e-2, sub_group_size=300)  # one group per expert
    cfg[ZP]["leaf_module"] = {"names": ["moe"]}
    with tiered.initialize(model, cfg) as engine:
        zp = engine.zero
        assert sum(not g.trainable for g in zp.groups) > 2  # more than the frozen groups backward keeps
        loss = engine(**rank_batches("moe")[0][0])
        before = zp.counters["fetches"]
        engine.backward(loss)
        assert zp.counters["fetches"] - before == len(zp.groups)  # each group gathered once
        assert zp.counters["backward_on_demand"] == 0
        engine.step()


def _tiny_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        router_jitter_noise=0.0,
    )
    cfg._attn_implementation = "eager"
    return MixtralForCausalLM(cfg)


def test_mixtral_moe_blocks_are_leaves_by_default_as_in_deepspeed() -> None:
    # an unchanged DeepSpeed config (no leaf_module key) means DeepSpeed's default leaf classes
    case = Case("mixtral", _tiny_mixtral, lambda g, n: {}, lambda out: out.loss)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    want_losses, want = reference_train(build(case), case, batches, lr=1e-2, weight_decay=0.1)
    got_losses, got, stats = tiered_train(
        build(case), case, batches, ds_config(param="cpu", opt="cpu", lr=1e-2, weight_decay=0.1)
    )
    assert stats["zero"]["leaf_modules"] == 2  # model.layers.{0,1}.mlp (MixtralSparseMoeBlock)
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)
