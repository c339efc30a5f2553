"""Every configuration key tiered recognises, and what it does with each one.

[Note: key classification]
Each key of a DeepSpeed or tiered config falls in exactly one class:

- ``supported``: mapped into the resolved `TieredConfig` and read by the engine.
- ``accepted``: parsed and validated exactly as DeepSpeed does (so the resolved config and
  `dump_config` keep it), but with no effect in tiered, for the reason listed; logged once at
  INFO. These are knobs of DeepSpeed machinery that tiered replaces by its own.
- ``ignored``: accepted and ignored *only* because it cannot change results by design — a logging
  or profiling switch for a logger tiered does not have, a knob of a DeepSpeed code path that
  tiered does not have (its effect is subsumed by tiered's own machinery), or a choice between
  implementations of the same math. Each is listed below with the reason, and the loader logs it
  at INFO once per process.
- ``default_only``: recognised; accepted only at a value that means "feature off" (listed in
  `allowed`), because tiered does not implement the feature. Any other value raises
  `UnsupportedConfigError` saying so and what to do.
- ``unsupported_if_enabled``: a whole DeepSpeed section (``elasticity``, ``pipeline``...) tiered
  does not implement. Present with ``"enabled": false`` (or no ``enabled``) it is ignored, and
  its inner keys are not checked; enabled, it raises `UnsupportedConfigError`.
  Ignored *sections* (the loggers, ``activation_checkpointing``) are likewise accepted whole,
  without checking their inner keys: they configure code tiered does not have, so a typo inside
  them cannot change what tiered does.
- ``section``: a nested object whose keys are classified by their own rows.
- ``reported``: a feature tiered does not have whose switch cannot change what is trained (a
  logger, a profiler): accepted whole, and when it is turned on (``"enabled": true``, or any
  setting for a key without one) a WARNING once names the key and says that it has no effect.
- keys starting with ``_`` (``"_comment"``) are comments at any depth and are skipped. (DeepSpeed
  skips them at the top level, where it ignores every unknown key; its sections are pydantic
  models that refuse them. A comment cannot change training, so tiered skips them everywhere.)
- anything else is unknown: `ConfigError` naming the full key path and either the section it
  belongs to (a known key in the wrong section: "aio belongs at the top level") or the nearest
  valid key.

Stages: tiered partitions parameters in every ZeRO stage. ``zero_optimization.stage`` 0, 1 and
2 run on the same machinery as stage 3 (on one GPU the stages differ only in what is sharded
across ranks, and tiered's partitions are its unit of offload); the stage is kept in
`ZeroConfig.stage` for reporting and for DeepSpeed's stage-dependent rules (offload_param needs
stage 3; overlap_comm defaults to true only for stage 3).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from tiered.errors import ConfigError, UnsupportedConfigError

log = logging.getLogger(__name__)

Kind = Literal[
    "supported", "accepted", "ignored", "reported", "default_only", "unsupported_if_enabled", "section"
]


@dataclass(frozen=True)
class KeyRule:
    path: str
    kind: Kind
    note: str = ""
    """Why it is ignored, or what to do instead when it is unsupported."""
    allowed: tuple[Any, ...] = ()
    """For default_only: the values that mean "off"."""


_S: Kind = "supported"
_I: Kind = "ignored"
_D: Kind = "default_only"
_E: Kind = "unsupported_if_enabled"
_SEC: Kind = "section"
_A: Kind = "accepted"
_R: Kind = "reported"

_LOGGER = "tiered has no such logger; use engine.stats() and tiered.trace_path (Chrome trace) instead"
_NOT_DS = "not a DeepSpeed key (DeepSpeed ignores unknown top-level keys); it configures nothing in either"
_DEEPCOMPILE = "a DeepCompile setting; it only acts with compile.deepcompile true, which tiered refuses"
_AUTOTP = "an AutoTP setting; it only acts with tensor_parallel.autotp_size > 1, which tiered refuses"
_COMM = "communication strategy of DeepSpeed's stage 1/2 path; tiered's partitioned machinery replaces it (same results)"

_RULES: tuple[KeyRule, ...] = (
    # --- top level -------------------------------------------------------------------------
    KeyRule("train_batch_size", _S),
    KeyRule("train_micro_batch_size_per_gpu", _S),
    KeyRule("gradient_accumulation_steps", _S),
    KeyRule("gradient_clipping", _S),
    KeyRule("steps_per_print", _S, "the engine logs a progress line every N steps (engine/progress.py)"),
    KeyRule("wall_clock_breakdown", _S, "adds the step's forward/backward/step seconds to that line"),
    KeyRule(
        "communication_data_type",
        _A,
        "tiered reduces each gradient across ranks in the dtype it is produced in (DeepSpeed's "
        "behaviour when the key is unset); on one process there is no reduction",
    ),
    KeyRule("optimizer", _SEC),
    KeyRule("scheduler", _SEC),
    KeyRule("bf16", _SEC),
    KeyRule("bfloat16", _SEC, note="alias of bf16"),
    KeyRule("fp16", _SEC),
    KeyRule("zero_optimization", _SEC),
    KeyRule("aio", _SEC),
    KeyRule("tiered", _SEC),
    KeyRule("zero_allow_untested_optimizer", _I, "tiered only runs Adam/AdamW, whose offload it tests"),
    KeyRule("zero_force_ds_cpu_optimizer", _I, "tiered always uses its own CPU Adam for offloaded state"),
    KeyRule(
        "prescale_gradients",
        _I,
        "tiered averages gradients once, in fp32; pre- or post-scaling gives the same mean",
    ),
    KeyRule(
        "gradient_predivide_factor",
        _I,
        "tiered averages gradients once, in fp32; the split of the division does not change the mean",
    ),
    KeyRule("memory_breakdown", _R, _LOGGER),
    KeyRule("log_level", _I, "tiered logs through Python's logging; configure the 'tiered' logger"),
    KeyRule("disable_python_gc", _I, "garbage-collection timing does not change results"),
    KeyRule("vocabulary_size", _I, "tiered reads shapes from the model"),
    KeyRule("gradient_allreduce_op", _D, 'tiered averages gradients across ranks; use "mean"', ("mean",)),
    KeyRule(
        "managed_gradient_accumulation",
        _D,
        "tiered's engine always manages gradient accumulation; set true",
        (True,),
    ),
    KeyRule("disable_allgather", _D, "a legacy stage-1 switch tiered does not have; set false", (False,)),
    KeyRule(
        "use_data_before_expert_parallelism", _D, "expert parallelism is not supported; set false", (False,)
    ),
    KeyRule("expert_parallel", _D, "expert parallelism is not supported; remove the section", (None, {})),
    KeyRule("dump_state", _R, _LOGGER),
    KeyRule("dataloader_drop_last", _I, "tiered does not build data loaders; your loader decides"),
    KeyRule("timers", _R, _LOGGER),
    KeyRule("flops_profiler", _R, _LOGGER),
    KeyRule("tensorboard", _R, _LOGGER),
    KeyRule("wandb", _R, _LOGGER),
    KeyRule("csv_monitor", _R, _LOGGER),
    KeyRule("comet", _R, _LOGGER),
    KeyRule("comms_logger", _R, _LOGGER),
    KeyRule("comms_config", _R, _NOT_DS),
    KeyRule("monitor_config", _R, _NOT_DS),
    KeyRule(
        "graph_harvesting",
        _D,
        "CUDA-graph capture of DeepSpeed's optimizer path is not supported; set false",
        (False,),
    ),
    KeyRule(
        "datastates_ckpt",
        _E,
        "DataStates checkpointing is not supported; tiered's checkpoints are atomic already",
    ),
    KeyRule(
        "activation_checkpointing",
        _R,
        "configures deepspeed.checkpointing.checkpoint(), which tiered does not provide; "
        "torch.utils.checkpoint in your model works unchanged under tiered",
    ),
    KeyRule("checkpoint", _SEC),
    KeyRule("data_types", _SEC),
    KeyRule("sparse_gradients", _D, "tiered keeps dense gradients; remove the key or set false", (False,)),
    KeyRule(
        "seq_parallel_communication_data_type",
        _D,
        "tiered has no sequence parallelism; remove the key",
        (None, "fp32"),
    ),
    KeyRule("amp", _E, 'apex AMP is not supported; use "bf16": {"enabled": true}'),
    KeyRule("torch_autocast", _E, 'use "bf16": {"enabled": true} (or fp16 with auto_cast)'),
    KeyRule("elasticity", _E, "elastic training is not supported; fix the batch sizes"),
    KeyRule("pipeline", _E, "pipeline parallelism is not supported"),
    KeyRule("curriculum_learning", _E, "curriculum learning is not supported"),
    KeyRule("data_efficiency", _E, "DeepSpeed data efficiency is not supported"),
    KeyRule("compression_training", _E, "compression training is not supported"),
    KeyRule("autotuning", _E, "DeepSpeed autotuning is not supported; try `tiered plan`"),
    KeyRule("hybrid_engine", _E, "the hybrid (RLHF) engine is not supported"),
    KeyRule("sparse_attention", _E, "sparse attention kernels are not supported"),
    KeyRule("quantize_training", _E, "quantized training is not supported"),
    KeyRule("weight_quantization", _E, "weight quantization is not supported"),
    KeyRule("progressive_layer_drop", _E, "progressive layer drop is not supported"),
    KeyRule("eigenvalue", _E, "eigenvalue computation is not supported"),
    KeyRule("nebula", _E, "Nebula checkpointing is not supported; tiered's checkpoints are atomic already"),
    KeyRule("compile", _SEC),
    KeyRule("zenflow", _E, "ZenFlow is not supported; tiered's step already pipelines sub-groups"),
    KeyRule("tensor_parallel", _SEC),
    # --- checkpoint / data_types -------------------------------------------------------------
    KeyRule("checkpoint.tag_validation", _I, "tiered validates checkpoint contents itself"),
    KeyRule("checkpoint.use_node_local_storage", _I, "tiered checkpoints are single-node"),
    KeyRule(
        "checkpoint.load_universal", _D, "tiered checkpoints are already per-parameter; set false", (False,)
    ),
    KeyRule(
        "checkpoint.parallel_write",
        _D,
        "parallel checkpoint writes are not supported; remove the key",
        (None,),
    ),
    KeyRule(
        "data_types.grad_accum_dtype",
        _D,
        'tiered accumulates gradients in fp32; use null or "fp32"',
        (None, "fp32"),
    ),
    KeyRule(
        "data_types.param_dtype",
        _D,
        "tiered keeps parameters in the compute dtype of bf16/fp16; use null",
        (None,),
    ),
    KeyRule("data_types.buffer_dtype", _D, "tiered leaves buffers at their loaded dtype; use null", (None,)),
    # --- compile / tensor_parallel: recognised, refused where they change what is run ---------
    KeyRule(
        "compile.deepcompile",
        _D,
        "DeepCompile replaces ZeRO's runtime by compiler passes, and tiered is its own ZeRO runtime; "
        "set false (torch.compile on your model's blocks works under tiered)",
        (False,),
    ),
    *(
        KeyRule(f"compile.{k}", _I, _DEEPCOMPILE)
        for k in (
            "free_activation",
            "free_activation_threshold",
            "offload_activation",
            "offload_activation_pin_memory",
            "offload_opt_states",
            "double_buffer",
            "symmetric_memory",
            "debug_log",
            "offload_parameters",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
            "passes",
        )
    ),
    *(
        KeyRule(
            f"compile.{k}",
            _R,
            "DeepSpeed's engine.compile() settings; tiered does not compile your model: call torch.compile "
            "on it yourself (same math)",
        )
        for k in ("disable", "backend", "kwargs", "enabled")
    ),
    KeyRule(
        "tensor_parallel.autotp_size",
        _D,
        "tensor parallelism (AutoTP) changes how the model is split and is not supported; use 0 or 1",
        (0, 1),
    ),
    KeyRule("tensor_parallel.tp", _SEC),
    KeyRule("tensor_parallel.tensor_parallel", _SEC, "alias of tensor_parallel.tp"),
    KeyRule("tensor_parallel.tp.tp_size", _D, "tensor parallelism is not supported; use 1", (1,)),
    KeyRule("tensor_parallel.tp.tp_grain_size", _I, _AUTOTP),
    KeyRule(
        "tensor_parallel.tensor_parallel.tp_size", _D, "tensor parallelism is not supported; use 1", (1,)
    ),
    KeyRule("tensor_parallel.tensor_parallel.tp_grain_size", _I, _AUTOTP),
    *(
        KeyRule(f"tensor_parallel.{k}", _I, _AUTOTP)
        for k in (
            "dtype",
            "tp_overlap_comm",
            "injection_policy_tuple",
            "partition_config",
            "preset_model",
            "keep_module_on_host",
            "replace_with_kernel_inject",
            "kernel_inject",
        )
    ),
    # --- optimizer ---------------------------------------------------------------------------
    KeyRule("optimizer.type", _S),
    KeyRule("optimizer.legacy_fusion", _I, "chooses between implementations of the same Adam math"),
    KeyRule("optimizer.params", _SEC),
    KeyRule("optimizer.params.lr", _S),
    KeyRule("optimizer.params.betas", _S),
    KeyRule("optimizer.params.eps", _S),
    KeyRule("optimizer.params.weight_decay", _S),
    KeyRule("optimizer.params.adam_w_mode", _S),
    KeyRule("optimizer.params.torch_adam", _I, "chooses between implementations of the same Adam math"),
    KeyRule("optimizer.params.fused", _I, "chooses between implementations of the same Adam math"),
    KeyRule("optimizer.params.foreach", _I, "chooses between implementations of the same Adam math"),
    KeyRule(
        "optimizer.params.bias_correction",
        _D,
        "tiered's Adam always applies bias correction; set true",
        (True,),
    ),
    KeyRule("optimizer.params.amsgrad", _D, "AMSGrad is not supported; set false", (False,)),
    KeyRule("optimizer.params.maximize", _D, "maximize is not supported; negate your loss", (False,)),
    # --- scheduler (params checked per type in config/scheduler.py) ---------------------------
    KeyRule("scheduler.type", _S),
    KeyRule("scheduler.params", _S),
    # --- precision ---------------------------------------------------------------------------
    KeyRule("bf16.enabled", _S),
    KeyRule(
        "bf16.immediate_grad_update",
        _I,
        "tiered accumulates bf16 gradients into fp32 as they arrive either way",
    ),
    KeyRule(
        "bf16.check_grad_overflow", _D, "bf16 runs without overflow checks in tiered; set false", (False,)
    ),
    KeyRule("fp16.enabled", _S),
    KeyRule("fp16.auto_cast", _S),
    KeyRule("fp16.loss_scale", _S),
    KeyRule("fp16.initial_scale_power", _S),
    KeyRule("fp16.loss_scale_window", _S),
    KeyRule("fp16.hysteresis", _S),
    KeyRule("fp16.consecutive_hysteresis", _S),
    KeyRule("fp16.min_loss_scale", _S),
    KeyRule(
        "fp16.fp16_master_weights_and_grads", _D, "tiered keeps fp32 master weights; set false", (False,)
    ),
    # --- zero_optimization -------------------------------------------------------------------
    KeyRule("zero_optimization.stage", _S),
    KeyRule("zero_optimization.offload_param", _SEC),
    KeyRule("zero_optimization.offload_optimizer", _SEC),
    KeyRule("zero_optimization.cpu_offload", _S, "deprecated alias: true means offload_optimizer.device cpu"),
    KeyRule(
        "zero_optimization.cpu_offload_param", _S, "deprecated alias: true means offload_param.device cpu"
    ),
    KeyRule("zero_optimization.cpu_offload_use_pin_memory", _S, "deprecated alias of pin_memory"),
    KeyRule("zero_optimization.stage3_prefetch_bucket_size", _S),
    KeyRule("zero_optimization.prefetch_bucket_size", _S),
    KeyRule("zero_optimization.stage3_param_persistence_threshold", _S),
    KeyRule("zero_optimization.param_persistence_threshold", _S),
    KeyRule("zero_optimization.stage3_model_persistence_threshold", _S),
    KeyRule("zero_optimization.model_persistence_threshold", _S),
    KeyRule("zero_optimization.stage3_max_live_parameters", _S),
    KeyRule("zero_optimization.max_live_parameters", _S),
    KeyRule("zero_optimization.stage3_max_reuse_distance", _S),
    KeyRule("zero_optimization.max_reuse_distance", _S),
    *(
        KeyRule(
            f"zero_optimization.{k}",
            _A,
            "tiered has no save_16bit_model(); engine.zero.gather_full_state_dict() always returns full weights",
        )
        for k in (
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        )
    ),
    KeyRule("zero_optimization.sub_group_size", _S),
    KeyRule(
        "zero_optimization.reduce_bucket_size",
        _A,
        "tiered reduces each shard group's gradient as soon as its backward ends; it has no bucket to size",
    ),
    KeyRule(
        "zero_optimization.overlap_comm",
        _A,
        "tiered's gathers, prefetches and write-backs always run on its tier loop, beside compute; in "
        "DeepSpeed the flag picks CUDA streams, not results",
    ),
    KeyRule(
        "zero_optimization.contiguous_gradients",
        _A,
        "tiered writes every gradient straight into its flat partition buffer (always contiguous)",
    ),
    KeyRule(
        "zero_optimization.reduce_scatter",
        _I,
        "tiered always reduce-scatters; all-reduce-then-slice yields the same gradients",
    ),
    KeyRule("zero_optimization.allgather_partitions", _I, _COMM),
    KeyRule(
        "zero_optimization.allgather_bucket_size",
        _I,
        _COMM + "; gathers are sized by stage3_prefetch_bucket_size",
    ),
    KeyRule("zero_optimization.round_robin_gradients", _I, _COMM),
    KeyRule(
        "zero_optimization.ignore_unused_parameters",
        _I,
        "tiered always tolerates parameters without gradients (DeepSpeed's default)",
    ),
    KeyRule(
        "zero_optimization.elastic_checkpoint",
        _I,
        "deprecated in DeepSpeed for stage 3; tiered checkpoints are per-parameter",
    ),
    KeyRule(
        "zero_optimization.memory_efficient_linear",
        _I,
        "only affects DeepSpeed's zero.Init patch of F.linear, which tiered does not use",
    ),
    KeyRule("zero_optimization.override_module_apply", _I, "tiered does not patch nn.Module.apply"),
    KeyRule(
        "zero_optimization.log_trace_cache_warnings",
        _I,
        "tiered counts trace divergences in engine.stats() and logs them at DEBUG",
    ),
    KeyRule("zero_optimization.enable_sanity_checks", _I, "cross-rank checks of DeepSpeed's reduce path"),
    KeyRule(
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        _I,
        "a collective choice with identical results",
    ),
    KeyRule(
        "zero_optimization.use_all_reduce_for_fetch_params", _I, "a collective choice with identical results"
    ),
    KeyRule(
        "zero_optimization.stage3_allgather_sequential", _I, "a collective choice with identical results"
    ),
    KeyRule("zero_optimization.allgather_sequential", _I, "a collective choice with identical results"),
    KeyRule(
        "zero_optimization.use_multi_rank_bucket_allreduce", _I, "a collective choice with identical results"
    ),
    KeyRule(
        "zero_optimization.parameter_alignment",
        _I,
        "padding of DeepSpeed's flat buffers; tiered aligns its partitions itself",
    ),
    KeyRule(
        "zero_optimization.pipeline_loading_checkpoint",
        _I,
        "a checkpoint-loading strategy of DeepSpeed's; tiered loads its own format",
    ),
    KeyRule(
        "zero_optimization.compute_grad_norm",
        _D,
        "tiered always computes the global gradient norm; set true",
        (True,),
    ),
    KeyRule(
        "zero_optimization.legacy_stage1",
        _D,
        "DeepSpeed's legacy stage 1 is not supported; set false",
        (False,),
    ),
    KeyRule(
        "zero_optimization.save_muon_momentum_buffer_in_memory",
        _D,
        "Muon is not supported; set false",
        (False,),
    ),
    KeyRule("zero_optimization.zenflow", _D, "ZenFlow is not supported; remove the key", (None,)),
    KeyRule(
        "zero_optimization.load_from_fp32_weights",
        _D,
        "tiered always restores the fp32 master weights from the checkpoint; set true",
        (True,),
    ),
    KeyRule(
        "zero_optimization.stage3_module_granularity_threshold",
        _D,
        "leaf modules chosen by size are not supported; name them in zero_optimization.leaf_module, or set 0",
        (0,),
    ),
    KeyRule(
        "zero_optimization.module_granularity_threshold",
        _D,
        "leaf modules chosen by size are not supported; name them in zero_optimization.leaf_module, or set 0",
        (0,),
    ),
    KeyRule(
        "zero_optimization.zero_hpz_partition_size",
        _D,
        "ZeRO++ hierarchical partitioning (hpZ) is not supported; set 1",
        (1,),
    ),
    KeyRule(
        "zero_optimization.zero_quantized_weights",
        _D,
        "ZeRO++ quantized weights (qwZ) are not supported; set false",
        (False,),
    ),
    KeyRule(
        "zero_optimization.zero_quantized_nontrainable_weights",
        _D,
        "ZeRO++ quantized weights are not supported; set false",
        (False,),
    ),
    KeyRule(
        "zero_optimization.zero_quantized_gradients",
        _D,
        "ZeRO++ quantized gradients (qgZ) are not supported; set false",
        (False,),
    ),
    KeyRule("zero_optimization.mics_shard_size", _D, "MiCS is not supported; remove the key", (-1,)),
    KeyRule(
        "zero_optimization.mics_hierarchical_params_gather", _D, "MiCS is not supported; set false", (False,)
    ),
    KeyRule("zero_optimization.leaf_module", _SEC),
    KeyRule("zero_optimization.leaf_module.classes", _S),
    KeyRule("zero_optimization.leaf_module.names", _S),
    KeyRule("zero_optimization.leaf_module.name_suffixes", _S),
    KeyRule("zero_optimization.offload_param.device", _S),
    KeyRule("zero_optimization.offload_param.nvme_path", _S),
    KeyRule("zero_optimization.offload_param.pin_memory", _S),
    KeyRule(
        "zero_optimization.offload_param.buffer_count",
        _A,
        "tiered has no fixed pool of parameter swap buffers: the gpu tier's budget and "
        "stage3_max_live_parameters bound what is gathered",
    ),
    KeyRule(
        "zero_optimization.offload_param.buffer_size",
        _A,
        "tiered moves each shard group in a buffer of its own size, so no parameter is too large for a pool",
    ),
    KeyRule("zero_optimization.offload_param.max_in_cpu", _S),
    KeyRule("zero_optimization.offload_optimizer.device", _S),
    KeyRule("zero_optimization.offload_optimizer.nvme_path", _S),
    KeyRule("zero_optimization.offload_optimizer.pin_memory", _S),
    KeyRule("zero_optimization.offload_optimizer.buffer_count", _S),
    KeyRule("zero_optimization.offload_optimizer.ratio", _S),
    KeyRule("zero_optimization.offload_optimizer.pipeline_read", _S),
    KeyRule("zero_optimization.offload_optimizer.pipeline_write", _S),
    KeyRule(
        "zero_optimization.offload_optimizer.fast_init",
        _A,
        "tiered writes the initial optimizer state from the fp32 shards directly; an init-speed choice",
    ),
    KeyRule(
        "zero_optimization.offload_optimizer.super_offload",
        _D,
        "SuperOffload (GH200) is not supported; set false",
        (False,),
    ),
    KeyRule(
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
        _I,
        "SuperOffload's core split; tiered sizes its CPU Adam pool itself",
    ),
    # --- aio ---------------------------------------------------------------------------------
    KeyRule("aio.block_size", _S),
    KeyRule("aio.queue_depth", _S),
    KeyRule("aio.thread_count", _S),
    KeyRule("aio.intra_op_parallelism", _S),
    KeyRule("aio.single_submit", _A, "tiered's nvme backend has no submission queue to configure"),
    KeyRule("aio.overlap_events", _A, "tiered's nvme backend has no submission queue to configure"),
    KeyRule("aio.use_gds", _S),
    # --- tiered's own ------------------------------------------------------------------------
    KeyRule("tiered.tiers", _SEC),
    KeyRule("tiered.trace_path", _S),
    KeyRule("tiered.timeout_s", _S),
    KeyRule("tiered.io_threads", _S),
    KeyRule("tiered.verify_checksums", _S),
    KeyRule("tiered.io_timeout_floor_s", _S),
    KeyRule("tiered.io_min_bytes_per_s", _S),
    KeyRule("tiered.io_retries", _S),
    KeyRule("tiered.io_retry_backoff_s", _S),
    KeyRule("tiered.io_retry_errnos", _S),
    KeyRule("tiered.overlap_step_with_backward", _S),
    KeyRule("tiered.nonfinite_step", _S),
    KeyRule("tiered.param_tier", _S),
    KeyRule("tiered.optimizer_tier", _S),
    KeyRule("tiered.grad_tier", _S),
    KeyRule("tiered.check_collective_order", _S),
    KeyRule("tiered.host_mmap_threshold", _S),
    KeyRule("tiered.optimizer_state_format", _S),
    # [Note: auto config] (tiered/planning/auto.py): resolved by tiered.initialize / finetune
    KeyRule("tiered.auto_config", _SEC),
    KeyRule("tiered.auto_config.cpu_mem", _S),
    KeyRule("tiered.auto_config.gpu_mem", _S),
    KeyRule("tiered.auto_config.nvme_mem", _S),
    KeyRule("tiered.auto_config.activation_mem", _S),
    KeyRule("tiered.auto_config.bandwidth", _S),
)

RULES: dict[str, KeyRule] = {rule.path: rule for rule in _RULES}
_CHILDREN: dict[str, list[str]] = {}
for _rule in _RULES:
    _parent, _, _leaf = _rule.path.rpartition(".")
    _CHILDREN.setdefault(_parent, []).append(_leaf)

_logged_ignored: set[str] = set()
_warned: set[str] = set()


def known_keys(section_path: str) -> list[str]:
    """Keys valid directly under `section_path` ("" is the top level)."""
    return list(_CHILDREN.get(section_path, ()))


def _join(section_path: str, key: str) -> str:
    return f"{section_path}.{key}" if section_path else key


_COMMENT_WORDS = frozenset({"comment", "comments", "note", "notes", "description", "doc", "remark"})


def is_comment(key: Any) -> bool:
    """A "_comment"-style key: skipped at any depth (see [Note: key classification])."""
    return isinstance(key, str) and key.startswith("_")


def _home_of(key: str, section_path: str) -> str | None:
    """Where a known key found in the wrong section belongs ("the top level", "zero_optimization")."""
    homes = [r.path.rpartition(".")[0] for r in _RULES if r.path.rpartition(".")[2] == key]
    homes = sorted(h for h in homes if h != section_path)
    if not homes or len(homes) > 2:  # a generic leaf ("enabled", "type") points nowhere useful
        return None
    return " or ".join("the top level" if h == "" else repr(h) for h in homes)


def unknown_key_error(section_path: str, key: str, valid: Iterable[str]) -> ConfigError:
    """ConfigError for an unknown key, naming its full path and where it belongs or the nearest valid key."""
    valid = list(valid)
    path = _join(section_path, key)
    home = _home_of(key, section_path)
    if home is not None:
        where = f'"{key}": {{...}}' if RULES.get(key, KeyRule("", _S)).kind == _SEC else key
        return ConfigError(
            f"configuration key {path!r} is in the wrong section: {key} belongs at {home}; move {where} there"
        )
    if key.strip().lower() in _COMMENT_WORDS:
        return ConfigError(
            f'unknown configuration key {path!r}; keys starting with "_" are comments: write "_{key}"'
        )
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {_join(section_path, close[0])!r}?"
    else:
        hint = f"valid keys here: {', '.join(sorted(valid))}"
    return ConfigError(f"unknown configuration key {path!r}; {hint}")


def check_section(section: dict[str, Any], section_path: str) -> None:
    """Classify every key of `section`: raise for unknown or unsupported ones, log ignored ones.

    Supported and accepted keys and sub-sections are left for the caller to read.
    """
    valid = known_keys(section_path)
    for key, value in section.items():
        if is_comment(key):
            continue
        path = _join(section_path, key)
        rule = RULES.get(path)
        if rule is None:
            raise unknown_key_error(section_path, key, valid)
        if rule.kind in ("ignored", "accepted"):
            _log_ignored(rule)
        elif rule.kind == "reported":
            _report(rule, value)
        elif rule.kind == "default_only":
            if not any(_same(value, ok) for ok in rule.allowed):
                raise UnsupportedConfigError(
                    f"{path} = {value!r} is recognised but not supported by tiered: {rule.note}"
                )
        elif rule.kind == "unsupported_if_enabled":
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a JSON object {{...}}, got {value!r}")
            if value.get("enabled", False) is not False:
                raise UnsupportedConfigError(
                    f"{path} is enabled, which tiered does not support: {rule.note}; "
                    f'remove the section or set "enabled": false'
                )
            _log_ignored(rule, "disabled section of an unsupported feature")


def _report(rule: KeyRule, value: Any) -> None:
    """WARNING once for a switched-on feature tiered does not have; INFO when it is off."""
    if isinstance(value, dict):
        on = value.get("enabled", any(not is_comment(k) for k in value)) not in (False, None)
    else:
        on = value not in (False, None)
    if not on:
        _log_ignored(rule, f"off here; {rule.note}")
        return
    if rule.path in _warned:
        return
    _warned.add(rule.path)
    log.warning(
        "config key %r accepted and ignored, but it is set and has no effect in tiered: %s",
        rule.path,
        rule.note,
    )


def _same(value: Any, allowed: Any) -> bool:
    # JSON has no int/bool distinction problem in Python: True == 1, so compare types for bools.
    if isinstance(allowed, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value == allowed
    if isinstance(allowed, (int, float)) and isinstance(value, str):
        try:
            return float(value) == allowed
        except ValueError:
            return False
    return value == allowed


def _log_ignored(rule: KeyRule, reason: str | None = None) -> None:
    if rule.path in _logged_ignored:
        return
    _logged_ignored.add(rule.path)
    log.info("config key %r accepted and ignored: %s", rule.path, reason or rule.note)


def ignored_keys_table() -> list[tuple[str, str]]:
    """(key path, reason) for every accepted-and-ignored key, for docs and `tiered plan`."""
    return [
        (r.path, r.note)
        for r in _RULES
        if r.kind in ("ignored", "accepted", "reported", "unsupported_if_enabled")
    ]
