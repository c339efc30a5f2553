"""`dump_config`: a resolved `TieredConfig` back to JSON, in DeepSpeed's spelling.

The output is explicit (every value written, derived tiers included; "auto" only for a key in
`TieredConfig.unset`, no optimizer section where that is unset) so that
``load_config(dump_config(cfg)) == cfg``: a run's exact configuration can be saved next to its
checkpoint and reloaded without the model that resolved its "auto" values.
"""

from __future__ import annotations

from typing import Any

import torch

from tiered.config.schema import TieredConfig


def dump_config(cfg: TieredConfig) -> dict[str, Any]:
    """JSON-able dict that `load_config` turns back into an equal `TieredConfig`."""
    z, p, o, a = cfg.zero, cfg.zero.offload_param, cfg.zero.offload_optimizer, cfg.aio
    offload_param: dict[str, Any] = {
        "device": p.device,
        "pin_memory": p.pin_memory,
        "buffer_count": p.buffer_count,
        "buffer_size": p.buffer_size_numel,
        "max_in_cpu": p.max_in_cpu_numel,
    }
    if p.nvme_path is not None:
        offload_param["nvme_path"] = p.nvme_path
    offload_opt: dict[str, Any] = {
        "device": o.device,
        "pin_memory": o.pin_memory,
        "buffer_count": o.buffer_count,
        "ratio": o.ratio,
        "pipeline_read": o.pipeline_read,
        "pipeline_write": o.pipeline_write,
        "fast_init": o.fast_init,
    }
    if o.nvme_path is not None:
        offload_opt["nvme_path"] = o.nvme_path
    out: dict[str, Any] = {
        "zero_optimization": {
            "stage": z.stage,
            "offload_param": offload_param,
            "offload_optimizer": offload_opt,
            "stage3_prefetch_bucket_size": z.prefetch_bucket_size_numel,
            "stage3_param_persistence_threshold": z.param_persistence_threshold_numel,
            "stage3_model_persistence_threshold": z.model_persistence_threshold_numel,
            "stage3_max_live_parameters": z.max_live_parameters_numel,
            "stage3_max_reuse_distance": z.max_reuse_distance_numel,
            "stage3_gather_16bit_weights_on_model_save": z.gather_16bit_weights_on_model_save,
            "sub_group_size": z.sub_group_size_numel,
            "reduce_bucket_size": z.reduce_bucket_size_numel,
            "overlap_comm": z.overlap_comm,
            "contiguous_gradients": z.contiguous_gradients,
            "leaf_module": {
                "classes": list(z.leaf_module.classes),
                "names": list(z.leaf_module.names),
                "name_suffixes": list(z.leaf_module.name_suffixes),
            },
        },
        "aio": {
            "block_size": a.block_size_bytes,
            "queue_depth": a.queue_depth,
            "thread_count": a.thread_count,
            "single_submit": a.single_submit,
            "overlap_events": a.overlap_events,
            "use_gds": a.use_gds,
        },
        "optimizer": {
            "type": cfg.optimizer.type,
            "params": {
                "lr": cfg.optimizer.lr,
                "betas": list(cfg.optimizer.betas),
                "eps": cfg.optimizer.eps,
                "weight_decay": cfg.optimizer.weight_decay,
                "adam_w_mode": cfg.optimizer.adamw_mode,
            },
        },
        "bf16": {"enabled": cfg.precision.dtype == torch.bfloat16},
        "fp16": {
            "enabled": cfg.precision.dtype == torch.float16,
            "auto_cast": cfg.precision.auto_cast,
            "loss_scale": cfg.precision.loss_scale,
            "initial_scale_power": cfg.precision.initial_scale_power,
            "loss_scale_window": cfg.precision.loss_scale_window,
            "hysteresis": cfg.precision.hysteresis,
            "consecutive_hysteresis": cfg.precision.consecutive_hysteresis,
            "min_loss_scale": cfg.precision.min_loss_scale,
        },
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping,
        "steps_per_print": cfg.steps_per_print,
        "wall_clock_breakdown": cfg.wall_clock_breakdown,
        "tiered": {
            "tiers": {
                name: {"backend": dict(spec.backend), "budget": spec.budget_bytes}
                for name, spec in cfg.tiered.tiers.items()
            },
            "trace_path": cfg.tiered.trace_path,
            "timeout_s": cfg.tiered.timeout_s,
            "io_threads": cfg.tiered.io_threads,
            "verify_checksums": cfg.tiered.verify_checksums,
            "io_timeout_floor_s": cfg.tiered.io_timeout_floor_s,
            "io_min_bytes_per_s": cfg.tiered.io_min_bytes_per_s,
            "io_retries": cfg.tiered.io_retries,
            "io_retry_backoff_s": cfg.tiered.io_retry_backoff_s,
            "io_retry_errnos": list(cfg.tiered.io_retry_errnos),
            "overlap_step_with_backward": cfg.zero.overlap_step_with_backward,
            "param_tier": cfg.tiered.param_tier,
            "optimizer_tier": cfg.tiered.optimizer_tier,
            "grad_tier": cfg.tiered.grad_tier,
            "check_collective_order": cfg.tiered.check_collective_order,
            "nonfinite_step": cfg.tiered.nonfinite_step,
            "host_mmap_threshold": cfg.tiered.host_mmap_threshold,
            "optimizer_state_format": cfg.tiered.optimizer_state_format,
        },
    }
    if cfg.scheduler is not None:
        out["scheduler"] = {"type": cfg.scheduler.type, "params": dict(cfg.scheduler.params)}
    if cfg.train_batch_size is not None:
        out["train_batch_size"] = cfg.train_batch_size
    if cfg.train_micro_batch_size_per_gpu is not None:
        out["train_micro_batch_size_per_gpu"] = cfg.train_micro_batch_size_per_gpu
    if cfg.communication_data_type is not None:
        out["communication_data_type"] = cfg.communication_data_type
    for path in cfg.unset:  # a placeholder is not a value: write what the config said
        if path == "optimizer":
            del out["optimizer"]
            continue
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = "auto"
    return out
