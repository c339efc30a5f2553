"""load_config / dump_config: DeepSpeed and HF configs load, defaults match DeepSpeed, "auto" resolves."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from tiered.config import Hyperparameters, SchedulerConfig, TierSpec, dump_config, load_config
from tiered.config import keys as config_keys

CONFIGS = Path(__file__).parent / "configs"


def _fixture(name: str, nvme_dir: Path | None = None) -> dict:
    data = json.loads((CONFIGS / name).read_text())
    if nvme_dir is not None:  # the docs' "/local_nvme" does not exist here
        for key in ("offload_param", "offload_optimizer"):
            section = data["zero_optimization"].get(key, {})
            if "nvme_path" in section:
                section["nvme_path"] = str(nvme_dir)
    return data


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(48, 192), torch.nn.GELU(), torch.nn.Linear(192, 48))


def _tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_empty_config_has_deepspeed_code_defaults():
    cfg = load_config({})
    z = cfg.zero
    # deepspeed/runtime/zero/config.py and offload_config.py (shared reference, section 1.6)
    assert z.stage == 0
    assert z.overlap_comm is False  # None -> True only for stage 3
    assert z.contiguous_gradients is True
    assert z.reduce_bucket_size_numel == 500_000_000
    assert z.sub_group_size_numel == 1_000_000_000
    assert z.prefetch_bucket_size_numel == 50_000_000  # the code's 5e7, not the docs' 5e8
    assert z.param_persistence_threshold_numel == 100_000
    assert z.model_persistence_threshold_numel == sys.maxsize
    assert z.max_live_parameters_numel == 1_000_000_000
    assert z.max_reuse_distance_numel == 1_000_000_000
    assert z.gather_16bit_weights_on_model_save is False
    p, o = z.offload_param, z.offload_optimizer
    assert (p.device, p.buffer_count, p.buffer_size_numel, p.max_in_cpu_numel, p.pin_memory) == (
        "none",
        5,
        100_000_000,
        1_000_000_000,
        True,
    )
    assert (
        o.device,
        o.buffer_count,
        o.pin_memory,
        o.ratio,
        o.pipeline_read,
        o.pipeline_write,
        o.fast_init,
    ) == ("none", 4, True, 1.0, False, False, False)
    # aio (swap_tensor/constants.py, section 3.4)
    a = cfg.aio
    assert (
        a.block_size_bytes,
        a.queue_depth,
        a.thread_count,
        a.single_submit,
        a.overlap_events,
        a.use_gds,
    ) == (1_048_576, 8, 1, False, True, False)
    # FusedAdam / DeepSpeedCPUAdam defaults
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.eps, cfg.optimizer.weight_decay) == (
        1e-3,
        (0.9, 0.999),
        1e-8,
        0.0,
    )
    assert cfg.precision.dtype == torch.float32
    assert (
        cfg.precision.loss_scale,
        cfg.precision.initial_scale_power,
        cfg.precision.loss_scale_window,
        cfg.precision.hysteresis,
        cfg.precision.min_loss_scale,
    ) == (0.0, 16, 1000, 2, 1.0)
    assert (cfg.gradient_accumulation_steps, cfg.gradient_clipping, cfg.steps_per_print) == (1, 0.0, 10)
    assert cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None
    assert cfg.scheduler is None
    assert set(cfg.tiered.tiers) == {"gpu", "cpu"}
    assert cfg.tiered.param_tier is None and cfg.tiered.optimizer_tier is None


def test_stage3_defaults_overlap_comm_true():
    assert load_config({"zero_optimization": {"stage": 3}}).zero.overlap_comm is True
    assert load_config({"zero_optimization": {"stage": 2}}).zero.overlap_comm is False


def test_hf_zero3_auto_with_tiny_llama():
    model = _tiny_llama()
    cfg = load_config(_fixture("hf_ds_config_zero3.json"), model=model, world_size=2)
    h = 32
    # transformers' formulas: H*H, int(0.9*H*H), 10*H
    assert cfg.zero.reduce_bucket_size_numel == h * h
    assert cfg.zero.prefetch_bucket_size_numel == int(0.9 * h * h)
    assert cfg.zero.param_persistence_threshold_numel == 10 * h
    assert cfg.zero.stage == 3 and cfg.zero.gather_16bit_weights_on_model_save is True
    assert cfg.zero.offload_param.device == "cpu" and cfg.zero.offload_optimizer.device == "cpu"
    assert cfg.tiered.param_tier == "cpu" and cfg.tiered.optimizer_tier == "cpu"
    assert cfg.steps_per_print == 2000
    # Every "auto" HF fills from TrainingArguments is unset without a caller: never invented
    # (this test used to assert lr 1e-3, micro batch 1, clipping 1.0 and warmup 1000).
    assert set(cfg.unset) == {
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.warmup_max_lr",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.enabled",
        "bf16.enabled",
    }
    assert cfg.train_micro_batch_size_per_gpu is None and cfg.train_batch_size is None
    # ... and filled exactly from the caller's values, as HF's trainer_config_process does
    hp = Hyperparameters(
        lr=5e-5,
        betas=(0.9, 0.95),
        eps=1e-6,
        weight_decay=0.1,
        warmup_steps=0,
        micro_batch_size=8,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        mixed_precision="no",
    )
    cfg = load_config(_fixture("hf_ds_config_zero3.json"), model=model, world_size=2, hyperparameters=hp)
    assert cfg.unset == ()
    assert (
        cfg.optimizer.type,
        cfg.optimizer.lr,
        cfg.optimizer.betas,
        cfg.optimizer.eps,
        cfg.optimizer.weight_decay,
    ) == ("AdamW", 5e-5, (0.9, 0.95), 1e-6, 0.1)
    assert cfg.train_micro_batch_size_per_gpu == 8 and cfg.gradient_accumulation_steps == 2
    assert cfg.train_batch_size == 32  # 8 * 2 * world_size
    assert cfg.gradient_clipping == 0.5
    assert cfg.precision.dtype == torch.float32
    assert cfg.scheduler == SchedulerConfig(
        "WarmupLR",
        {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 5e-5,
            "warmup_num_steps": 1,
            "warmup_type": "log",
            "last_batch_iteration": -1,
        },  # HF: max(1, warmup_steps)
    )
    assert load_config(dump_config(cfg), world_size=2) == cfg


def test_auto_from_plain_mlp_uses_largest_linear_in_features():
    cfg = load_config(_fixture("hf_ds_config_zero2.json"), model=_mlp())
    assert cfg.zero.stage == 2
    assert cfg.zero.reduce_bucket_size_numel == 192 * 192
    assert cfg.zero.offload_optimizer.device == "cpu" and cfg.zero.offload_param.device == "none"


def test_deepspeed_tutorial_zero3_offload():
    cfg = load_config(_fixture("ds_zero3_offload_tutorial.json"))
    assert cfg.zero.prefetch_bucket_size_numel == 10_000_000
    assert cfg.zero.reduce_bucket_size_numel == 10_000_000
    assert cfg.zero.param_persistence_threshold_numel == 100_000
    assert isinstance(cfg.zero.sub_group_size_numel, int)
    assert cfg.tiered.param_tier == "cpu"


@pytest.mark.parametrize("name", ["ds_zero_infinity_nvme.json", "hf_ds_config_zero3_nvme.json"])
def test_nvme_configs_derive_nvme_tier_from_aio(tmp_path, name):
    data = _fixture(name, tmp_path / "nvme")
    cfg = load_config(data, model=_mlp())
    assert not (tmp_path / "nvme").exists()  # made when the backend opens it: parsing is pure
    aio = data["aio"]
    assert cfg.tiered.tiers["nvme"] == TierSpec(
        backend={
            "type": "nvme",
            "path": str(tmp_path / "nvme"),
            "block_size": aio["block_size"],
            "queue_depth": aio["queue_depth"],
            "thread_count": aio["thread_count"],
            "atomic": False,
            "fsync": False,  # swap files: the nvme backend's scratch mode,
            "swap": True,  # in a per-process directory that close() removes
            "create": True,  # the folder, once the backend opens it ([Note: config parsing is pure])
        }
    )
    assert cfg.tiered.param_tier == "nvme" and cfg.tiered.optimizer_tier == "nvme"
    assert cfg.zero.offload_param.buffer_size_numel == 100_000_000
    assert cfg.zero.offload_param.max_in_cpu_numel == 1_000_000_000


def test_infinity_example_precision_and_adam_mode(tmp_path):
    cfg = load_config(_fixture("ds_zero_infinity_nvme.json", tmp_path))
    assert cfg.precision.dtype == torch.float16 and cfg.precision.initial_scale_power == 16
    # DeepSpeed: type "Adam" with adam_w_mode defaulting to True runs AdamW.
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.adamw_mode is True
    assert cfg.optimizer.betas == (0.8, 0.999) and cfg.optimizer.weight_decay == 3e-7


def test_deepspeed_zero2_fp16_batch_derivation(caplog):
    config_keys._logged_ignored.clear()
    with caplog.at_level(logging.INFO, logger="tiered.config.keys"):
        cfg = load_config(_fixture("ds_zero2_fp16.json"), world_size=4)
    assert cfg.gradient_accumulation_steps == 2  # 64 / (8 * 4)
    assert cfg.precision.loss_scale_window == 500 and cfg.precision.initial_scale_power == 15
    assert cfg.scheduler.type == "WarmupDecayLR" and cfg.scheduler.params["total_num_steps"] == 10_000
    logged = caplog.text
    assert "'tensorboard' accepted and ignored" in logged
    assert "'zero_optimization.allgather_bucket_size' accepted and ignored" in logged


def test_split_nvme_paths_give_two_tiers(tmp_path):
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "b")},
            },
            "aio": {"intra_op_parallelism": 4},
        }
    )
    assert cfg.tiered.tiers["nvme"].backend["path"] == str(tmp_path / "a")
    assert cfg.tiered.tiers["nvme_optimizer"].backend["path"] == str(tmp_path / "b")
    assert cfg.tiered.tiers["nvme_optimizer"].backend["thread_count"] == 4
    assert cfg.tiered.param_tier == "nvme" and cfg.tiered.optimizer_tier == "nvme_optimizer"


def test_tiered_native_config():
    cfg = load_config(CONFIGS / "tiered_native.json")
    assert cfg.tiered.tiers["gpu"] == TierSpec(backend={"type": "gpu"}, budget_bytes=2 * 2**30)
    assert cfg.tiered.tiers["cpu"].budget_bytes == 16 * 2**30
    assert (cfg.tiered.trace_path, cfg.tiered.timeout_s, cfg.tiered.io_threads) == ("trace.json", 120.0, 4)
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.lr == 3e-4 and cfg.optimizer.weight_decay == 0.1
    assert cfg.precision.dtype == torch.bfloat16
    assert cfg.zero.sub_group_size_numel == 500_000_000 and cfg.zero.offload_optimizer.ratio == 0.5
    assert cfg.train_batch_size == 8
    assert cfg.scheduler.params["total_num_steps"] == "auto"


def test_custom_tier_as_optimizer_tier():
    cfg = load_config(
        {
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "tiered": {
                "tiers": {"remote": {"backend": {"type": "tensorstore", "path": "x"}, "budget": "1TB"}},
                "optimizer_tier": "remote",
                "overlap_step_with_backward": True,
            },
        }
    )
    assert cfg.tiered.optimizer_tier == "remote"
    assert cfg.tiered.tiers["remote"].budget_bytes == 10**12
    assert set(cfg.tiered.tiers) == {"gpu", "cpu", "remote"}
    assert cfg.zero.overlap_step_with_backward is True
    assert load_config(dump_config(cfg)) == cfg


def test_aliases_and_number_spellings():
    cfg = load_config(
        {
            "bfloat16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": "5e8",
                "gather_16bit_weights_on_model_save": True,
                "max_live_parameters": 2e9,
                "cpu_offload": True,
                "cpu_offload_param": True,
            },
            "aio": {"thread_count": 3},
            "communication_data_type": "bf16",
        }
    )
    assert cfg.precision.dtype == torch.bfloat16
    assert cfg.zero.prefetch_bucket_size_numel == 500_000_000
    assert cfg.zero.max_live_parameters_numel == 2_000_000_000
    assert cfg.zero.gather_16bit_weights_on_model_save is True
    assert cfg.zero.offload_optimizer.device == "cpu" and cfg.zero.offload_param.device == "cpu"
    assert cfg.aio.thread_count == 3
    assert cfg.communication_data_type == "bf16"


def test_adam_l2_mode_and_disabled_unsupported_section_accepted():
    cfg = load_config(
        {
            "optimizer": {"type": "adam", "params": {"adam_w_mode": False, "torch_adam": True}},
            "elasticity": {"enabled": False, "max_train_batch_size": 10},
        }
    )
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.adamw_mode is False


@pytest.mark.parametrize(
    ("optimizer", "weight_decay"),
    [
        ({"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}}, 0.01),  # torch.optim.AdamW(**params)
        ({"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}, 0.01),
        (
            {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True, "adam_w_mode": False}},
            0.0,
        ),  # torch Adam
        ({"type": "Adam", "params": {"lr": 0.1, "torch_adam": True, "weight_decay": 0.2}}, 0.2),
        ({"type": "Adam", "params": {"lr": 0.1, "torch_adam": False}}, 0.0),  # FusedAdam / CPUAdam
        ({"type": "AdamW", "params": {"lr": 0.1}}, 0.0),
    ],
)
def test_weight_decay_left_out_is_the_default_of_the_adam_deepspeed_builds(
    optimizer: dict[str, object], weight_decay: float
) -> None:
    """A config from a public project (InternVL's adam_fp16.json) sets torch_adam and no
    weight_decay: DeepSpeed builds torch.optim.AdamW from the params, whose default is 0.01."""
    assert load_config({"optimizer": optimizer}).optimizer.weight_decay == weight_decay


def test_batch_rules():
    assert (
        load_config(
            {"train_batch_size": 32, "gradient_accumulation_steps": 4}, world_size=2
        ).train_micro_batch_size_per_gpu
        == 4
    )
    cfg = load_config({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, world_size=2)
    assert cfg.train_batch_size == 30
    cfg = load_config({"train_batch_size": 12}, world_size=3)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 1)
    cfg = load_config(
        {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
        world_size=2,
    )
    assert cfg.train_batch_size == 24


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_round_trip_dump_then_load_is_equal(tmp_path, name):
    data = _fixture(name, tmp_path / "nvme")
    cfg = load_config(data, model=_mlp(), world_size=2)
    dumped = dump_config(cfg)
    text = json.dumps(dumped)  # JSON-able
    again = load_config(json.loads(text), world_size=2)  # batch sizes were resolved for 2 ranks
    assert again == cfg
    path = tmp_path / "cfg.json"
    path.write_text(text)
    assert load_config(path, world_size=2) == cfg


def test_round_trip_with_split_nvme_and_scheduler(tmp_path):
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 500, "warmup_type": "linear"},
            },
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p")},
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": str(tmp_path / "o"),
                    "pipeline_read": True,
                    "pipeline_write": True,
                },
            },
            "fp16": {"enabled": True, "auto_cast": True, "consecutive_hysteresis": True},
        }
    )
    assert cfg.zero.offload_optimizer.pipeline_read and cfg.zero.offload_optimizer.pipeline_write
    assert load_config(dump_config(cfg)) == cfg
    assert list(tmp_path.iterdir()) == []  # neither read wrote a folder ([Note: config parsing is pure])


_DS_ZERO_SECTIONS = [
    {},
    {"stage": 3},
    {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": False},
        "stage3_prefetch_bucket_size": 2e7,
        "gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu", "ratio": 0.3},
    },
]


@pytest.mark.parametrize("section", _DS_ZERO_SECTIONS)
def test_zero_section_matches_deepspeed_parser(section):
    """Oracle: DeepSpeed's own pydantic parser, where DeepSpeed is installed (a peer, not a dependency)."""
    ds_config = pytest.importorskip("deepspeed.runtime.zero.config")
    ds = ds_config.DeepSpeedZeroConfig(**json.loads(json.dumps(section)))
    z = load_config({"zero_optimization": section}).zero
    assert z.stage == ds.stage
    assert z.overlap_comm == ds.overlap_comm
    assert z.contiguous_gradients == ds.contiguous_gradients
    assert z.reduce_bucket_size_numel == ds.reduce_bucket_size
    assert z.sub_group_size_numel == ds.sub_group_size
    assert z.prefetch_bucket_size_numel == ds.prefetch_bucket_size
    assert z.param_persistence_threshold_numel == ds.param_persistence_threshold
    assert z.model_persistence_threshold_numel == ds.model_persistence_threshold
    assert z.max_live_parameters_numel == ds.max_live_parameters
    assert z.max_reuse_distance_numel == ds.max_reuse_distance
    assert z.gather_16bit_weights_on_model_save == ds.gather_16bit_weights_on_model_save
    if ds.offload_param is not None:
        p = ds.offload_param
        assert (
            z.offload_param.device,
            z.offload_param.buffer_count,
            z.offload_param.buffer_size_numel,
            z.offload_param.max_in_cpu_numel,
            z.offload_param.pin_memory,
        ) == (p.device, p.buffer_count, p.buffer_size, p.max_in_cpu, p.pin_memory)
    if ds.offload_optimizer is not None:
        o = ds.offload_optimizer
        assert (
            z.offload_optimizer.device,
            z.offload_optimizer.buffer_count,
            z.offload_optimizer.pin_memory,
            z.offload_optimizer.ratio,
            z.offload_optimizer.pipeline_read,
            z.offload_optimizer.fast_init,
        ) == (o.device, o.buffer_count, o.pin_memory, o.ratio, o.pipeline_read, o.fast_init)


def test_aio_defaults_match_deepspeed():
    aio_config = pytest.importorskip("deepspeed.runtime.swap_tensor.aio_config")
    ds = aio_config.get_aio_config({})
    a = load_config({}).aio
    assert (
        a.block_size_bytes,
        a.queue_depth,
        a.thread_count,
        a.single_submit,
        a.overlap_events,
        a.use_gds,
    ) == (
        ds["block_size"],
        ds["queue_depth"],
        ds["intra_op_parallelism"],
        ds["single_submit"],
        ds["overlap_events"],
        ds["use_gds"],
    )


def test_user_nvme_backend_for_offload_tier_inherits_derived_keys(tmp_path):
    nvme = str(tmp_path / "nvme")
    base = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "aio": {"block_size": 262144, "queue_depth": 4},
    }
    cfg = load_config({**base, "tiered": {"tiers": {"nvme": {"backend": {"type": "nvme", "path": nvme}}}}})
    spec = cfg.tiered.tiers["nvme"].backend
    assert spec["block_size"] == 262144 and spec["queue_depth"] == 4
    assert spec["atomic"] is False and spec["fsync"] is False  # swap files: scratch mode
    assert spec["swap"] is True
    kept = load_config({**base, "tiered": {"tiers": {"nvme": {"backend": {"type": "nvme", "atomic": True}}}}})
    assert kept.tiered.tiers["nvme"].backend["atomic"] is True  # what the user wrote wins
    files = load_config({**base, "tiered": {"tiers": {"nvme": {"backend": {"type": "nvme", "swap": False}}}}})
    assert files.tiered.tiers["nvme"].backend["swap"] is False


def test_user_declared_nvme_tier_is_not_a_swap_tier(tmp_path):
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
            },
            "tiered": {"tiers": {"disk": {"backend": {"type": "nvme", "path": str(tmp_path / "b")}}}},
        }
    )
    assert cfg.tiered.tiers["nvme"].backend["swap"] is True  # derived from nvme_path: swap files
    assert cfg.tiered.tiers["disk"].backend == {"type": "nvme", "path": str(tmp_path / "b")}  # the user's own
