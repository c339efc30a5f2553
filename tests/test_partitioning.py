"""Flat shard groups: layout, persistence, tied parameters, initial values, meta models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from zero_support import MLP, build_zp, make_tm, tiny_gpt2, zcfg, zero_grads_by_name

from tiered.errors import CapacityError, ConfigError
from tiered.shards import padded_numel
from tiered.zero.plan import plan_param_groups as plan_groups
from tiered.zero.sharding import ALIGNMENT_NUMEL


def test_plan_one_group_per_module_split_at_sub_group_size():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 30))  # 110 and 330 elements
    groups = plan_groups(
        model,
        sub_group_size_numel=320,
        param_persistence_threshold_numel=0,
        model_persistence_threshold_numel=10**9,
    )
    assert [[n for n, _ in g.params] for g in groups] == [["0.weight", "0.bias"], ["1.weight"], ["1.bias"]]
    with pytest.raises(ValueError, match="sub_group_size"):
        plan_groups(
            model,
            sub_group_size_numel=0,
            param_persistence_threshold_numel=0,
            model_persistence_threshold_numel=0,
        )


def test_plan_persistent_small_params_and_model_cap():
    model = nn.Sequential(nn.Linear(10, 10), nn.LayerNorm(10), nn.Linear(10, 10))
    groups = plan_groups(
        model,
        sub_group_size_numel=10**9,
        param_persistence_threshold_numel=10,
        model_persistence_threshold_numel=30,
    )
    persistent = [g for g in groups if g.persistent]
    assert len(persistent) == 1
    # biases and norm weights (10 elements each) until the model-wide cap of 30
    assert [n for n, _ in persistent[0].params] == ["0.bias", "1.weight", "1.bias"]
    names = [n for g in groups if not g.persistent for n, _ in g.params]
    assert names == ["0.weight", "2.weight", "2.bias"]


def test_tied_parameter_belongs_to_first_owner():
    model = tiny_gpt2()
    groups = plan_groups(
        model,
        sub_group_size_numel=10**9,
        param_persistence_threshold_numel=0,
        model_persistence_threshold_numel=0,
    )
    names = [n for g in groups for n, _ in g.params]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert len(names) == len({id(p) for p in model.parameters()})


def test_shards_are_aligned_and_values_round_trip(tmp_path):
    torch.manual_seed(0)
    model = MLP(d=8, depth=2)
    ref = copy.deepcopy(model)
    with make_tm(tmp_path) as tm:
        zp = build_zp(model, tm, dtype=torch.bfloat16, param_tier="nvme")
        for g in zp.groups:
            assert g.full_numel % ALIGNMENT_NUMEL == 0 and g.full_numel >= g.numel
            assert g.shard_numel == g.full_numel and g.shard_offset == 0
            assert g.param.dtype == torch.bfloat16 and g.grad.dtype == torch.float32
            assert g.param.home == "nvme" and g.grad.home == "cpu"
            master = zp.initial_fp32_shard(g)
            assert master.dtype == torch.float32 and master.numel() == g.shard_numel
            for e in g.entries:
                exact = dict(ref.named_parameters())[e.name].detach().reshape(-1)
                assert torch.equal(master[e.offset : e.offset + e.numel], exact)  # fp32, not via bf16
            assert torch.count_nonzero(master[g.numel :]) == 0
            with pytest.raises(RuntimeError, match="already taken"):
                zp.initial_fp32_shard(g)
        sd = zp.gather_full_state_dict()
        for n, p in ref.named_parameters():
            assert sd[n].dtype == torch.bfloat16
            assert torch.equal(sd[n], p.detach().to(torch.bfloat16))
        assert all(p.numel() == 0 for p in model.parameters())  # released again


def test_padded_numel():
    assert padded_numel(1, 1, 64) == 64
    assert padded_numel(130, 2, 64) == 256
    assert padded_numel(128, 2, 64) == 128


def test_max_live_smaller_than_largest_module_fails_before_training(tmp_path):
    model = MLP(d=16, depth=2)
    with make_tm(tmp_path) as tm:
        with pytest.raises(ConfigError, match=r"stage3_max_live_parameters.*'layers\.0'.*at least 272"):
            build_zp(model, tm, zcfg(max_live_parameters_numel=100))


def test_gpu_budget_smaller_than_largest_module_fails_before_training(tmp_path):
    model = MLP(d=64, depth=2)
    with make_tm(tmp_path, gpu_budget=1000) as tm:
        with pytest.raises(CapacityError, match=r"gpu tier budget 1000 bytes is too small.*at least"):
            build_zp(model, tm)


def test_unknown_tier_is_a_clear_error(tmp_path):
    with make_tm(tmp_path) as tm:
        with pytest.raises(ConfigError, match="'ssd' is not configured"):
            build_zp(MLP(), tm, param_tier="ssd")


def test_meta_model_materialised_group_by_group(tmp_path):
    torch.manual_seed(0)
    real = MLP(d=32, depth=4)
    with torch.device("meta"):
        meta = MLP(d=32, depth=4)
    assert all(p.is_meta for p in meta.parameters())
    with make_tm(tmp_path) as tm:
        live: list[int] = []
        create = tm.create

        def spy(*a, **kw):  # host elements holding real parameter storage when a partition is written
            live.append(sum(p.numel() for p in meta.parameters() if not p.is_meta))
            return create(*a, **kw)

        tm.create = spy
        torch.manual_seed(0)  # same RNG stream: reset_parameters per module, in module order
        zp = build_zp(meta, tm, param_tier="nvme")
        sd = zp.gather_full_state_dict()
        for n, p in real.named_parameters():
            assert torch.equal(sd[n], p.detach()), n
        # peak host parameter storage while partitioning: about one group, not the model
        assert max(live) <= max(g.numel for g in zp.groups) < sum(p.numel() for p in real.parameters()) / 2
        # the model trains: forward/backward through the materialised partitions
        ref = copy.deepcopy(real)
        x = torch.randn(4, 32)
        meta(x).sum().backward()
        zp.finish_backward()
        ref(x).sum().backward()
        grads = zero_grads_by_name(zp)
        for n, p in ref.named_parameters():
            assert torch.equal(grads[n], p.grad), n
        assert all(not p.is_meta and p.numel() == 0 for p in meta.parameters())


def test_meta_hf_model_uses_init_weights(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with make_tm(tmp_path) as tm:
        zp = build_zp(model, tm)
        sd = zp.gather_full_state_dict()
        # _init_weights: normal(0, initializer_range) linears/embeddings, ones for RMSNorm
        assert abs(sd["model.layers.0.mlp.up_proj.weight"].std().item() - 0.5) < 0.05
        assert torch.equal(sd["model.norm.weight"], torch.ones(32))
        ids = torch.randint(0, 64, (2, 8))
        out = model(input_ids=ids, labels=ids)
        assert torch.isfinite(out.loss)


def test_hf_blocks_are_one_group_each_unless_over_the_cap() -> None:
    # [Note: group planning]: a model's _no_split_modules (GPT2Block) are the gather unit
    model = tiny_gpt2()
    assert "GPT2Block" in model._no_split_modules
    kw = dict(
        sub_group_size_numel=10**9,
        param_persistence_threshold_numel=0,
        model_persistence_threshold_numel=10**12,
    )
    groups = plan_groups(model, **kw)
    block_groups = [g for g in groups if g.params[0][0].startswith("transformer.h.")]
    n_blocks = len(model.transformer.h)
    assert len(block_groups) == n_blocks
    for i, g in enumerate(block_groups):
        names = {q for q, _ in g.params}
        assert names == {f"transformer.h.{i}.{n}" for n, _ in model.transformer.h[i].named_parameters()}
    block_numel = sum(p.numel() for p in model.transformer.h[0].parameters())
    # a cap below one block's size: planned module by module, as without blocks
    per_module = plan_groups(model, **kw, max_block_numel=block_numel - 1)
    assert per_module == plan_groups(model, **kw, block_types=frozenset())
    assert len(per_module) > len(groups)
    # every parameter is placed exactly once either way
    for plan in (groups, per_module):
        placed = [id(p) for g in plan for _, p in g.params]
        assert len(placed) == len(set(placed)) == len({id(p) for p in model.parameters()})
