"""The rows of the key table for keys that are not declared on a schema field: DeepSpeed's keys
tiered accepts, ignores, reports or refuses, and the sections ([Note: key classification] in
tiered/config/keys.py, which joins these with the declared keys and applies them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

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

UNDECLARED_RULES: tuple[KeyRule, ...] = (
    # --- top level -------------------------------------------------------------------------
    KeyRule("optimizer", _SEC, "the optimizer (missing: built from lr= etc., or an error)"),
    KeyRule("scheduler", _SEC, "the lr schedule (missing: constant lr)"),
    KeyRule("bf16", _SEC, "bf16 mixed precision"),
    KeyRule("bfloat16", _SEC, note="alias of bf16"),
    KeyRule("fp16", _SEC, "fp16 mixed precision"),
    KeyRule("zero_optimization", _SEC, "ZeRO partitioning and offload"),
    KeyRule("aio", _SEC, "the nvme backend's I/O (block size, queue depth, threads)"),
    KeyRule("tiered", _SEC, "tiered's own keys (tiers, budgets, trace)"),
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
    KeyRule("checkpoint", _SEC, "DeepSpeed checkpoint options"),
    KeyRule("data_types", _SEC, "DeepSpeed dtype options"),
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
    KeyRule("compile", _SEC, "DeepSpeed compile options"),
    KeyRule("zenflow", _E, "ZenFlow is not supported; tiered's step already pipelines sub-groups"),
    KeyRule("tensor_parallel", _SEC, "DeepSpeed AutoTP options"),
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
    KeyRule("tensor_parallel.tp", _SEC, "AutoTP's TPConfig"),
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
    KeyRule("optimizer.legacy_fusion", _I, "chooses between implementations of the same Adam math"),
    KeyRule("optimizer.params", _SEC, "Adam's parameters"),
    KeyRule(
        "optimizer.params.torch_adam",
        _I,
        "chooses between implementations of the same Adam math; DeepSpeed then builds torch.optim.AdamW, "
        "so a weight_decay left out is its 0.01 (read so)",
    ),
    KeyRule(
        "optimizer.params.fp32_optimizer_states",
        _D,
        "DeepSpeedCPUAdam's state precision: tiered's is tiered.optimizer_state_format (fp32 by default); "
        "set true here and use that key",
        (True,),
    ),
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
    KeyRule("scheduler.type", _S, "WarmupLR, WarmupDecayLR, WarmupCosineLR with DeepSpeed's formulas"),
    KeyRule(
        "scheduler.params",
        _S,
        'DeepSpeed\'s params; warmup_num_steps "auto": warmup_steps=; total_num_steps "auto": total_steps=; warmup_max_lr "auto": the lr; warmup_min_lr "auto": 0',
    ),
    # --- precision ---------------------------------------------------------------------------
    KeyRule("bf16.enabled", _S, 'bf16 compute, fp32 master weights; "auto": mixed_precision='),
    KeyRule(
        "bf16.bf16_master_weights_and_grads",
        _D,
        "tiered keeps fp32 master weights and accumulates gradients in fp32; set false",
        (False,),
    ),
    KeyRule(
        "bf16.bf16_optimizer_states",
        _D,
        'Adam moments in bf16 are tiered.optimizer_state_format "bf16"; set false here and use that key',
        (False,),
    ),
    KeyRule(
        "bf16.immediate_grad_update",
        _I,
        "tiered accumulates bf16 gradients into fp32 as they arrive either way",
    ),
    KeyRule(
        "fp16.enabled", _S, 'fp16 compute with dynamic (or static) loss scaling; "auto": mixed_precision='
    ),
    KeyRule(
        "fp16.fp16_master_weights_and_grads", _D, "tiered keeps fp32 master weights; set false", (False,)
    ),
    # --- zero_optimization -------------------------------------------------------------------
    KeyRule("zero_optimization.offload_param", _SEC, "where parameters are offloaded"),
    KeyRule("zero_optimization.offload_optimizer", _SEC, "where optimizer state is offloaded"),
    KeyRule("zero_optimization.cpu_offload", _S, "deprecated alias: true means offload_optimizer.device cpu"),
    KeyRule(
        "zero_optimization.cpu_offload_param", _S, "deprecated alias: true means offload_param.device cpu"
    ),
    KeyRule("zero_optimization.cpu_offload_use_pin_memory", _S, "deprecated alias of pin_memory"),
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
        "zero_optimization.zeropp_loco_param",
        _D,
        "ZeRO++ LoCo gradient compression is not supported; remove it or set null",
        (None,),
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
    KeyRule(
        "zero_optimization.leaf_module",
        _SEC,
        "ZeRO-3 leaf modules, as DeepSpeed: a leaf gathers its whole subtree on entry and reduces it at its backward boundary, so that ranks routing tokens to different experts or taking different branches issue the same collectives (see [Leaf modules](#leaf-modules-moe-and-branches-across-ranks))",
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
    # --- tiered's own ------------------------------------------------------------------------
    KeyRule("tiered.tiers", _SEC, "tiers by name: backend spec and byte budget"),
    # [Note: auto config] (tiered/planning/auto.py): resolved by tiered.initialize / finetune
    KeyRule("tiered.auto_config", _SEC, "the memories the planner fits a config to ([Note: auto config])"),
    KeyRule("tiered.auto_config.cpu_mem", _S, "host memory to fit (a byte size)"),
    KeyRule("tiered.auto_config.gpu_mem", _S, "GPU memory to fit (a byte size)"),
    KeyRule("tiered.auto_config.nvme_mem", _S, "NVMe space to fit (a byte size)"),
    KeyRule("tiered.auto_config.activation_mem", _S, "GPU memory reserved for activations"),
    KeyRule("tiered.auto_config.bandwidth", _S, "`tiered bench --json` output that ranks the configs"),
)
