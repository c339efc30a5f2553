"""Bad configuration: every error names the key path (or file) and says what to do."""

from __future__ import annotations

import pytest
import torch

from tiered.config import load_config
from tiered.errors import ConfigError, UnsupportedConfigError

ZP = "zero_optimization"


def _raises(config, *fragments, exc=ConfigError, **kwargs):
    with pytest.raises(exc) as info:
        load_config(config, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


# --- unknown keys: full path and the nearest valid key --------------------------------------------


def test_unknown_zero_key_names_path_and_nearest():
    err = _raises(
        {ZP: {"stage": 3, "stage3_prefetch_bucket_sze": 1}},
        "'zero_optimization.stage3_prefetch_bucket_sze'",
        "did you mean 'zero_optimization.stage3_prefetch_bucket_size'",
    )
    assert not isinstance(err, UnsupportedConfigError)


def test_unknown_top_level_key():
    _raises(
        {"gradient_acumulation_steps": 2},
        "'gradient_acumulation_steps'",
        "did you mean 'gradient_accumulation_steps'",
    )


def test_unknown_nested_offload_key():
    _raises(
        {ZP: {"stage": 3, "offload_param": {"device": "cpu", "nvme_pth": "/x"}}},
        "'zero_optimization.offload_param.nvme_pth'",
        "'zero_optimization.offload_param.nvme_path'",
    )


def test_unknown_aio_optimizer_and_tier_keys():
    _raises({"aio": {"queue_dept": 4}}, "'aio.queue_dept'", "'aio.queue_depth'")
    _raises(
        {"optimizer": {"type": "Adam", "params": {"betas1": 0.9}}},
        "'optimizer.params.betas1'",
        "'optimizer.params.betas'",
    )
    _raises(
        {"tiered": {"tiers": {"gpu": {"budgit": "1GB"}}}},
        "'tiered.tiers.gpu.budgit'",
        "'tiered.tiers.gpu.budget'",
    )
    _raises({"tiered": {"timeout": 3}}, "'tiered.timeout'", "'tiered.timeout_s'")


def test_unknown_scheduler_param():
    _raises(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_l": 1}}},
        "'scheduler.params.warmup_max_l'",
        "'scheduler.params.warmup_max_lr'",
    )


def test_unknown_key_without_close_match_lists_valid_keys():
    _raises({"bf16": {"xyzzy": True}}, "'bf16.xyzzy'", "valid keys here:", "enabled")


# --- recognised but unsupported ------------------------------------------------------------------


def test_zero_plus_plus_quantized_weights_unsupported():
    _raises(
        {ZP: {"stage": 3, "zero_quantized_weights": True}},
        "zero_optimization.zero_quantized_weights",
        "not supported",
        "set false",
        exc=UnsupportedConfigError,
    )
    load_config({ZP: {"stage": 3, "zero_quantized_weights": False, "zero_hpz_partition_size": 1}})


@pytest.mark.parametrize("name", ["Lamb", "OneBitAdam", "SGD", "lion"])
def test_other_deepspeed_optimizers_unsupported(name):
    _raises(
        {"optimizer": {"type": name, "params": {}}},
        f"optimizer.type = {name!r}",
        '"Adam" or "AdamW"',
        exc=UnsupportedConfigError,
    )


def test_unknown_optimizer_type_unsupported():
    _raises(
        {"optimizer": {"type": "Adamm"}}, "optimizer.type = 'Adamm'", '"AdamW"', exc=UnsupportedConfigError
    )


def test_optimizer_missing_type():
    _raises({"optimizer": {"params": {"lr": 1}}}, "optimizer.type is missing")


def test_amsgrad_and_adamw_contradiction():
    _raises(
        {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
        "optimizer.params.amsgrad",
        exc=UnsupportedConfigError,
    )
    _raises(
        {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
        "optimizer.params.adam_w_mode",
        '"type": "Adam"',
    )


def test_unsupported_scheduler_type():
    _raises(
        {"scheduler": {"type": "OneCycle", "params": {}}},
        "scheduler.type = 'OneCycle'",
        "WarmupLR",
        exc=UnsupportedConfigError,
    )
    _raises({"scheduler": {"type": "Cosine"}}, "scheduler.type", "WarmupCosineLR")


def test_enabled_unsupported_section():
    _raises(
        {"elasticity": {"enabled": True}},
        "elasticity is enabled",
        '"enabled": false',
        exc=UnsupportedConfigError,
    )
    _raises({"amp": {"enabled": True}}, "amp is enabled", "bf16", exc=UnsupportedConfigError)


def test_use_gds():
    config = {ZP: {"stage": 3}, "aio": {"use_gds": True}}
    if torch.cuda.is_available():
        assert load_config(config).aio.use_gds is True
    else:
        _raises(
            config, "aio.use_gds", "CUDA is not available", '"use_gds": false', exc=UnsupportedConfigError
        )


# --- consistency checks --------------------------------------------------------------------------


def test_bf16_and_fp16_both_enabled():
    _raises(
        {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled", "fp16.enabled", "only one"
    )


def test_bf16_alias_twice():
    _raises({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bf16", "bfloat16", "keep only one")


def test_batch_size_mismatch_names_all_keys():
    _raises(
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
        "train_batch_size (10)",
        "train_micro_batch_size_per_gpu (2)",
        "gradient_accumulation_steps (2)",
        "world_size (2)",
        "= 8",
        world_size=2,
    )


def test_batch_size_not_divisible():
    _raises(
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
        "train_batch_size (10)",
        "train_micro_batch_size_per_gpu (4)",
    )
    _raises(
        {"train_batch_size": 10, "gradient_accumulation_steps": 3},
        "train_batch_size (10)",
        "gradient_accumulation_steps (3)",
    )
    _raises({"train_batch_size": 7}, "train_batch_size (7)", "world_size (2)", world_size=2)


def test_nvme_without_path():
    _raises(
        {ZP: {"stage": 3, "offload_param": {"device": "nvme"}}},
        "zero_optimization.offload_param.nvme_path is not set",
    )
    _raises(
        {ZP: {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        "zero_optimization.offload_optimizer.nvme_path is not set",
    )


def test_nvme_path_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = blocker / "swap"
    _raises(
        {ZP: {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(bad)}}},
        "zero_optimization.offload_param.nvme_path",
        str(bad),
        "cannot create",
    )
    _raises(
        {ZP: {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(blocker)}}},
        "zero_optimization.offload_optimizer.nvme_path",
        str(blocker),
        "not a directory",
    )


def test_nvme_path_not_writable(tmp_path, monkeypatch):
    # chmod cannot stop root (tests may run as root), so make the permission check say "no".
    import tiered.config.sections as sections

    monkeypatch.setattr(sections.os, "access", lambda path, mode: False)
    _raises(
        {ZP: {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}},
        "zero_optimization.offload_param.nvme_path",
        str(tmp_path),
        "not writable",
    )


def test_offload_param_needs_stage3():
    _raises(
        {ZP: {"stage": 2, "offload_param": {"device": "cpu"}}},
        "zero_optimization.offload_param.device",
        "zero_optimization.stage 3 (got 2)",
    )
    _raises({ZP: {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer", "got 0")
    _raises({ZP: {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "ratio", "stage 3")


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5])
def test_ratio_out_of_range(ratio):
    _raises(
        {ZP: {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}},
        "zero_optimization.offload_optimizer.ratio",
        "out of range",
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("reduce_bucket_size", -1),
        ("stage3_prefetch_bucket_size", "-5e8"),
        ("stage3_max_live_parameters", -2e9),
    ],
)
def test_negative_sizes(key, value):
    _raises({ZP: {"stage": 3, key: value}}, f"zero_optimization.{key}", "negative")


def test_buffer_count_and_sub_group_size_minimums():
    _raises(
        {ZP: {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}},
        "zero_optimization.offload_param.buffer_count",
        "minimum 1",
    )
    _raises(
        {ZP: {"stage": 3, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}},
        "zero_optimization.offload_optimizer.buffer_count",
    )
    # sub_group_size 0 is valid in DeepSpeed (one parameter per sub-group): see test_config_zoo
    _raises({ZP: {"stage": 3, "sub_group_size": -1}}, "zero_optimization.sub_group_size", "negative")


def test_bad_numbers():
    _raises({ZP: {"reduce_bucket_size": "5e8x"}}, "zero_optimization.reduce_bucket_size", "'5e8x'")
    _raises({ZP: {"reduce_bucket_size": 1.5}}, "zero_optimization.reduce_bucket_size", "not a whole number")
    _raises({ZP: {"reduce_bucket_size": True}}, "zero_optimization.reduce_bucket_size")
    _raises({ZP: {"stage": 4}}, "zero_optimization.stage", "0, 1, 2 or 3")
    _raises({ZP: {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm", "true or false")
    _raises(
        {ZP: {"stage": 3, "offload_param": {"device": "disk"}}},
        "zero_optimization.offload_param.device",
        "'nvme'",
    )
    _raises({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas", "pair")
    _raises({"communication_data_type": "fp8"}, "communication_data_type", "'bf16'")


def test_aliases_given_twice():
    _raises(
        {ZP: {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}},
        "zero_optimization.stage3_prefetch_bucket_size and zero_optimization.prefetch_bucket_size",
        "keep only one",
    )
    _raises(
        {"aio": {"thread_count": 1, "intra_op_parallelism": 2}},
        "aio.thread_count",
        "aio.intra_op_parallelism",
    )


def test_auto_without_model():
    _raises(
        {ZP: {"stage": 3, "reduce_bucket_size": "auto"}},
        "zero_optimization.reduce_bucket_size",
        "pass model=",
    )
    _raises(
        {ZP: {"stage": 3, "stage3_param_persistence_threshold": "auto"}},
        "zero_optimization.stage3_param_persistence_threshold",
        "hidden size",
        model=torch.nn.Sequential(torch.nn.ReLU()),
    )


# --- the tiered section --------------------------------------------------------------------------


def test_bad_budget_names_key():
    _raises({"tiered": {"tiers": {"cpu": {"budget": "16 GiBs"}}}}, "tiered.tiers.cpu.budget", "unknown unit")
    _raises({"tiered": {"tiers": {"cpu": {"budget": -1}}}}, "tiered.tiers.cpu.budget")


def test_custom_tier_without_backend():
    _raises({"tiered": {"tiers": {"remote": {"budget": "1TB"}}}}, "tiered.tiers.remote.backend is missing")
    _raises({"tiered": {"tiers": {"remote": {"backend": {"path": "x"}}}}}, "tiered.tiers.remote.backend.type")


def test_nvme_tier_without_backend_and_no_nvme_offload():
    _raises({"tiered": {"tiers": {"nvme": {"budget": "1TB"}}}}, "tiered.tiers.nvme.backend is missing")


def test_nvme_tier_path_contradicts_offload_path(tmp_path):
    _raises(
        {
            ZP: {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "a")}},
            "tiered": {"tiers": {"nvme": {"backend": {"type": "nvme", "path": str(tmp_path / "b")}}}},
        },
        "tiered.tiers.nvme.backend.path",
        "contradicts",
    )


def test_offload_tier_names():
    _raises(
        {ZP: {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "tiered": {"optimizer_tier": "nope"}},
        "tiered.optimizer_tier = 'nope' names no tier",
        "cpu, gpu",
    )
    _raises({"tiered": {"param_tier": "cpu"}}, "tiered.param_tier", 'offload_param.device is "none"')


def test_tiered_scalar_checks():
    _raises({"tiered": {"timeout_s": 0}}, "tiered.timeout_s")
    _raises({"tiered": {"io_threads": 0}}, "tiered.io_threads")


# --- sources -------------------------------------------------------------------------------------


def test_json_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "zero_optimization": {\n    "stage": 3,\n  }\n}\n')
    _raises(path, str(path), "line 4")
    _raises(str(path), "not valid JSON")


def test_duplicate_key_in_file(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"zero_optimization": {"stage": 3, "stage": 2}}')
    _raises(path, "dup.json", "'stage' appears twice")


def test_missing_file_and_bad_source(tmp_path):
    _raises(tmp_path / "nope.json", "nope.json", "does not exist")
    _raises([1, 2], "expected a dict or a JSON file path")
    path = tmp_path / "list.json"
    path.write_text("[1]")
    _raises(path, "top level must be a JSON object")
    _raises({}, "world_size", world_size=0)


def test_section_must_be_object():
    _raises({ZP: [1]}, "zero_optimization", "JSON object")
    _raises({"optimizer": {"type": "Adam", "params": "lr=1"}}, "optimizer.params", "JSON object")


# --- issue 23's config-level bad inputs: each was accepted (or died in a raw error) before ---------


@pytest.mark.parametrize(
    "config, where",
    [
        # DeepSpeed enables compression methods by a nested shared_parameters.enabled
        (
            {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
            "compression_training.weight_quantization.shared_parameters",
        ),
        ({"sparse_attention": {"mode": "fixed", "block": 16}}, "sparse_attention"),  # on by presence
        ({"sparse_attention": {"enabled": False, "layout": {"enabled": True}}}, "sparse_attention.layout"),
    ],
)
def test_unsupported_feature_enabled_below_its_section_is_refused(config, where):
    _raises(config, f"{where} is enabled", '"enabled": false', exc=UnsupportedConfigError)


def test_unsupported_feature_switched_off_is_still_accepted():
    load_config({"sparse_attention": {"enabled": False, "mode": "fixed"}})
    load_config({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}}})


def test_eps_zero_is_refused_at_load_by_name():
    _raises({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 0}}}, "optimizer.params.eps", "> 0")
    from tiered.config import Hyperparameters

    with pytest.raises(ConfigError, match="eps="):
        Hyperparameters(eps=0.0)


def test_huge_aio_block_size_is_refused_by_name():
    _raises({"aio": {"block_size": 2**40}}, "aio.block_size", "aio.queue_depth", "1 GiB")
    load_config({"aio": {"block_size": 8 << 20, "queue_depth": 32}})  # 256 MiB chunks: allowed


def _deep(depth: int) -> dict:
    node: dict = {}
    root = {"tiered": {"tiers": {"custom": {"backend": {"type": "tensorstore", "spec": node}}}}}
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


def test_deeply_nested_config_is_a_config_error_not_recursion(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"tiered": {"x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}}")
    _raises(str(path), str(path), "deeper")
    _raises(_deep(100_000), "tiered.tiers.custom.backend.spec.a", "deeper than 64")
    load_config(_deep(8))  # a backend spec some levels deep is fine


@pytest.mark.parametrize(
    ("section", "off", "on", "named"),
    [
        (
            "bf16",
            {"bf16_master_weights_and_grads": False},
            {"bf16_master_weights_and_grads": True},
            "fp32 master",
        ),
        ("bf16", {"bf16_optimizer_states": False}, {"bf16_optimizer_states": True}, "optimizer_state_format"),
        ("zero_optimization", {"zeropp_loco_param": None}, {"zeropp_loco_param": {"err_beta": 0.8}}, "LoCo"),
    ],
)
def test_recent_deepspeed_keys_are_recognised_at_their_off_value(
    section: str, off: dict[str, object], on: dict[str, object], named: str
) -> None:
    """Keys of DeepSpeed releases before the API tiered follows, written by real configs at
    their defaults: accepted off, refused on with what to use instead (they were 'unknown')."""
    base = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    load_config({**base, section: {**base[section], **off}})
    with pytest.raises(ConfigError, match=f"recognised but not supported.*{named}"):
        load_config({**base, section: {**base[section], **on}})


def test_cpu_adams_fp32_optimizer_states_is_recognised() -> None:
    opt = {"type": "AdamW", "params": {"lr": 1e-3, "fp32_optimizer_states": True}}
    load_config({"optimizer": opt})
    opt["params"]["fp32_optimizer_states"] = False  # type: ignore[index]
    with pytest.raises(ConfigError, match="fp32_optimizer_states.*tiered.optimizer_state_format"):
        load_config({"optimizer": opt})
