"""``deepspeed.moe`` ([Note: MoE without expert parallelism]): the group splitter passes a model
without expert layers through, as DeepSpeedExamples' CIFAR script calls it, and the expert-parallel
``MoE`` layer (and a parameter marked as an expert's) is refused naming the alternative."""

from __future__ import annotations

import pytest
import torch

import tiered.deepspeed as deepspeed
from tiered.deepspeed.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)
from tiered.errors import UnsupportedConfigError


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_a_model_without_experts_passes_through_as_a_list_of_the_same_groups() -> None:
    net = model()
    group = {"params": (p for p in net.parameters()), "name": "parameters", "weight_decay": 0.1}
    out = split_params_into_different_moe_groups_for_optimizer(group)
    assert out == [group] and out[0] is group
    assert out[0]["params"] == list(net.parameters())  # the generator read once, into a list
    groups = ({"params": [net[0].weight]}, {"params": [net[0].bias, net[2].weight, net[2].bias]})
    out = split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=1000)
    assert out == list(groups)
    assert split_params_into_shared_and_expert_params(net.parameters()) == (list(net.parameters()), [])


def test_the_split_groups_train_through_initialize() -> None:
    net = model()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in net.parameters()], "name": "parameters"}
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups, config=cfg)
    with engine:
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
        assert engine.global_steps == 1


def test_moe_layer_is_refused_naming_the_alternative() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"no expert parallelism.*set_leaf_modules"):
        deepspeed.moe.layer.MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)


def test_an_expert_parameter_is_refused_by_the_splitter() -> None:
    net = model()
    net[2].weight.allreduce = False  # type: ignore[attr-defined]  # how DeepSpeed's layer marks one
    assert is_moe_param(net[2].weight) and not is_moe_param(net[2].bias)
    with pytest.raises(UnsupportedConfigError, match=r"param group 0 \(parameters\) holds 1 expert"):
        split_params_into_different_moe_groups_for_optimizer(
            {"params": list(net.parameters()), "name": "parameters"}
        )
    with pytest.raises(ValueError, match="Unknown param group type"):
        split_params_into_different_moe_groups_for_optimizer(iter([]))  # type: ignore[arg-type]
