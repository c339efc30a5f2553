"""The public face: `tiered.initialize(model, config) -> Engine`.

[Note: engine step semantics]
As in DeepSpeed: ``backward(loss)`` divides the loss by gradient_accumulation_steps (and, in
fp16, multiplies it by the loss scale) before autograd runs; the ZeRO-3 scheduler accumulates the
resulting gradients in fp32 on their tier. ``step()`` is called after every micro-batch and only
acts at the accumulation boundary: it checks fp16 overflow (any rank) and skips the step, lowering
the scale; otherwise it computes the global gradient norm across ranks, the clip coefficient
(torch.nn.utils.clip_grad_norm_'s rule) and the lr (the scheduler at the number of optimizer steps
taken so far), runs the offloaded optimizer with ``grad_scale = clip_coef / loss_scale`` (see
[Note: clipping by grad_scale]) and zeroes the gradients. ``global_steps`` counts boundaries,
skipped ones included (DeepSpeed's meaning); the optimizer's bias-correction step and the
scheduler only advance on steps taken.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tiered.config.schema import TieredConfig
from tiered.engine.build import unmark_managed
from tiered.engine.ds_api import DeepSpeedEngineAPI
from tiered.engine.facade import ConfigLRScheduler
from tiered.engine.inputs import cast_floating, check_inputs, input_dtype_error
from tiered.engine.nonfinite import NonFiniteGuard
from tiered.engine.persistence import EnginePersistence, refuse_use_while_empty
from tiered.engine.progress import report_step
from tiered.engine.signals import unwatch as unwatch_sigterm
from tiered.engine.zero_grad import redirect_zero_grad
from tiered.errors import StorageIOError
from tiered.optim.arrivals import grads_consumed_from_memory, overlap_step_applies
from tiered.optim.clip import clip_coefficient, global_grad_norm
from tiered.optim.loss_scaler import build_loss_scaler
from tiered.planning.residency import Residency

if TYPE_CHECKING:
    from tiered.engine.build import Placement
    from tiered.engine.client import ClientSide
    from tiered.optim.offload import OffloadedAdam
    from tiered.optim.schedulers import LRSchedule
    from tiered.shards import ShardGroup
    from tiered.tiers import TierManager
    from tiered.zero import ZeroParameters

log = logging.getLogger(__name__)


def _is_enospc(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__
    return False


class _ConstantLR:
    def __init__(self, lr: float) -> None:
        self.lr = lr

    def lr_at(self, step: int) -> float:
        return self.lr


class Engine(DeepSpeedEngineAPI):
    """Forward, backward, step and stats over a ZeRO-3 partitioned, offloaded model.

    Built by `tiered.initialize`; see [Note: engine step semantics]. The rest of DeepSpeed's
    engine API (zero_grad, train, eval, device, ...) is `DeepSpeedEngineAPI`.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        cfg: TieredConfig,
        tm: TierManager,
        zp: ZeroParameters,
        optimizer: OffloadedAdam,
        placement: Placement,
        *,
        process_group: Any = None,
        world_size: int = 1,
        rank: int = 0,
        scheduler: LRSchedule | None = None,
        capacity: dict[str, Any] | None = None,
        host_memory: Mapping[str, Any] | None = None,
        client: ClientSide | None = None,
        tokenizer_source: str | None = None,
        traffic_floor: dict[str, int] | None = None,
        tier_memory: dict[str, str] | None = None,
        residency: Residency | None = None,
    ) -> None:
        self._module = module
        self.config = cfg
        self.tm = tm
        self.zero = zp
        self.optimizer = optimizer
        self.placement = placement
        self.process_group = process_group
        self.world_size = world_size
        self.rank = rank
        self.client = client
        """DeepSpeed's keywords made into the facade, client scheduler and loader
        (tiered.engine.client); None for ``tiered.initialize(model, config)``."""
        self._persistence = EnginePersistence(
            module,
            cfg,
            tm,
            zp,
            optimizer,
            placement,
            rank=rank,
            world_size=world_size,
            process_group=process_group,
        )
        """Checkpoints, exports and full values over these partitions (tiered/engine/persistence.py)."""
        self.scheduler: LRSchedule = (
            client.lr_source
            if client is not None and client.lr_source is not None
            else scheduler
            if scheduler is not None
            else _ConstantLR(cfg.optimizer.lr)
        )
        self._lr_scales = (1.0,) if client is None else client.lr_scales
        """Each param group's lr as a multiple of the base lr the optimizer steps with."""
        self.lr_scheduler: Any = (
            client.lr_scheduler
            if client is not None and client.lr_scheduler is not None
            else ConfigLRScheduler(cfg.scheduler.type, self.get_lr, lambda: self.optimizer.step_count)
            if cfg.scheduler is not None
            else None
        )
        """DeepSpeed's ``engine.lr_scheduler``: the client's, else a view of the config's schedule."""
        self.loss_scaler = build_loss_scaler(cfg.precision)
        self.capacity = capacity or {}
        self._host_extra = dict(host_memory or {})
        """`tiered.planning.needs.HostExtra`: the host bytes beyond the tiers the plan counts."""
        self._traffic_floor = traffic_floor or {}
        """[Note: bytes per step]'s floor per link for this run (tiered/planning/traffic.py)."""
        self._tier_memory = tier_memory or {}
        self.residency = residency if residency is not None else Residency()
        """What the faster tiers keep across steps ([Note: residency] in tiered/planning/residency.py)."""
        self.tokenizer_source = tokenizer_source
        """The folder the weights came from (from_pretrained, initialize(weights=...)): the
        tokenizer files `save_pretrained` copies by default."""
        self.gas = int(cfg.gradient_accumulation_steps)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._found_inf = False
        self._sq_norm_local = 0.0
        self._backward_since_step = False
        self._step_applied = False
        self._closed = False
        self._timing = {"forward_s": 0.0, "backward_s": 0.0, "step_s": 0.0, "optimizer_s": 0.0}
        self._last: dict[str, float] = {}
        # Only clipping and the fp16 overflow check need the gradient norm; otherwise the pass
        # reading every gradient once more is skipped (on a 40B model: 160 GB read per step) and
        # ``last_grad_norm`` reports None.
        self._needs_grad_norm = float(cfg.gradient_clipping) > 0 or cfg.precision.dtype == torch.float16
        self.nonfinite = NonFiniteGuard(cfg, zp, norm_computed=self._needs_grad_norm)
        self.overlap_step = overlap_step_applies(cfg)
        if self.overlap_step:
            zp.on_group_grads_complete(self._group_grads_complete)
        if grads_consumed_from_memory(cfg):  # [Note: gradient consumed from memory] in tiered/optim/group.py
            zp.keep_flushed_grads(keeper=optimizer.keep_grads_in_memory())
        # the model's own zero_grad reaches the engine: [Note: zero_grad of the model]
        self._undo_zero_grad = redirect_zero_grad(
            module, self, None if client is None else client.client_optimizer
        )

    # ---- the training loop -----------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def get_lr(self) -> list[float]:
        """The lr the next optimizer step will use (a list per param group, as DeepSpeed)."""
        base = self._base_lr()
        return [base * s for s in self._lr_scales]

    def _base_lr(self) -> float:
        """The lr handed to the optimizer (per-group lrs are multiples of it)."""
        return float(self.scheduler.lr_at(self.optimizer.step_count))

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        t0 = time.perf_counter()
        if self.config.precision.auto_cast and self.config.precision.dtype == torch.float16:  # fp16.auto_cast
            args, kwargs = cast_floating(args, torch.float16), cast_floating(kwargs, torch.float16)
        check_inputs(self._module, args, kwargs)
        try:
            out = self._module(*args, **kwargs)
        except RuntimeError as e:
            clear = input_dtype_error(e, self._module, self.placement.compute_dtype, args, kwargs)
            if clear is None:
                raise
            raise clear from e
        dt = time.perf_counter() - t0
        self._timing["forward_s"] += dt
        self._last["forward_s"] = self._last.get("forward_s", 0.0) + dt
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """loss / gas (x loss scale in fp16), autograd, then flush the gradients to their tier.

        As DeepSpeed's: `retain_graph` goes to autograd; ``scale_wrt_gas=False`` skips the division
        by gradient_accumulation_steps (for a loss already divided, as Hugging Face's Trainer does)."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "engine.backward(loss): loss must be a scalar tensor (e.g. out.loss or out.mean()), "
                f"got {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
            )
        if not loss.requires_grad:
            raise ValueError(
                "engine.backward(loss): loss does not require grad; was it computed by engine(...)?"
            )
        t0 = time.perf_counter()
        scaled = loss.float() if loss.dtype != torch.float32 else loss
        if self.gas != 1 and scale_wrt_gas:
            scaled = scaled / self.gas
        if self.loss_scaler.scale != 1.0:
            scaled = scaled * self.loss_scaler.scale
        micro = self.micro_steps % self.gas + 1  # [Note: non-finite steps]
        finite = self.nonfinite.loss_flag(loss)
        if self.is_gradient_accumulation_boundary():
            if (
                self.overlap_step
                and self.nonfinite.loss_is_finite_now(loss, micro)
                and not self.nonfinite.seen
            ):
                self.optimizer.begin_overlapped_step(
                    self._base_lr(), 1.0
                )  # [Note: step overlapped with backward]
            else:
                self.optimizer.prefetch_states()
        flushes = self.zero.counters["grad_flushes"]
        try:
            scaled.backward(retain_graph=retain_graph)
            summary = self.zero.finish_backward(summarize=self._needs_grad_norm)
        except BaseException:
            self.optimizer.finish_overlapped_step(abort=True)
            raise
        if self.zero.counters["grad_flushes"] == flushes:
            self.optimizer.finish_overlapped_step(abort=True)
            raise ValueError(
                "engine.backward(loss): no parameter the engine trains got a gradient from this loss, "
                "so it was not computed by engine(...) (or it ignores every trainable parameter); "
                "compute the loss from the engine's forward output. Nothing was counted"
            )
        self.nonfinite.after_backward(finite, loss, summary, micro)
        self._found_inf = self._found_inf or bool(summary.found_inf)
        self._sq_norm_local = float(summary.sq_norm_local)
        self._backward_since_step = True
        dt = time.perf_counter() - t0
        self._timing["backward_s"] += dt
        self._last["backward_s"] = self._last.get("backward_s", 0.0) + dt

    def _group_grads_complete(self, group: ShardGroup) -> None:
        if self.optimizer.overlapped_step_running:  # (frozen groups never flush)
            self.zero.seal_for_step(group)
            self.optimizer.group_ready(group)

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary run (or skip) the optimizer step."""
        self._check_open()
        if self._backward_since_step and (self.micro_steps + 1) % self.gas == 0:
            # the last step's write-backs end first: one that failed (a full disk) raises here,
            # before anything of this step is done, so after `flush()` with space freed the same
            # call goes on ([Note: a failed write-back is retried by flush])
            self._wait_writes("engine.step()")
        self.micro_steps += 1
        self._step_applied = False
        if self.micro_steps % self.gas != 0:
            return
        if not self._backward_since_step:
            raise RuntimeError(
                "engine.step() at an accumulation boundary without engine.backward(loss) first"
            )
        t0 = time.perf_counter()
        self.global_steps += 1
        overflow = self._any_rank(self._found_inf or self.nonfinite.seen)
        scale = self.loss_scaler.scale
        refusal: Exception | None = None
        if overflow and self.nonfinite.active:  # bf16/fp32: [Note: non-finite steps]
            self.skipped_steps += 1
            self.last_grad_norm = float("nan")
            applied = self.optimizer.overlapped_step_running
            if applied:
                self.optimizer.finish_overlapped_step()  # (what began in backward ends either way)
                self.zero.params_updated()
            refusal = self.nonfinite.refuse_step(self.global_steps, applied=applied)
        elif overflow and self.config.precision.dtype == torch.float16:
            self.skipped_steps += 1
            self.loss_scaler.update(True)
            log.info(
                "fp16 overflow at step %d: step skipped, loss scale %g -> %g",
                self.global_steps,
                scale,
                self.loss_scaler.scale,
            )
            self.last_grad_norm = float("inf")
        else:
            norm = (
                global_grad_norm(self._sq_norm_local, process_group=self.process_group) / scale
                if self._needs_grad_norm
                else float("nan")
            )
            self.last_grad_norm = norm
            coef = clip_coefficient(norm, float(self.config.gradient_clipping))
            lr = self._base_lr()
            t1 = time.perf_counter()
            if self.optimizer.overlapped_step_running:  # begun in backward with coef 1, scale 1
                self.optimizer.finish_overlapped_step()
            else:
                self.optimizer.step(lr, coef / scale)
            self._timing["optimizer_s"] += time.perf_counter() - t1
            self.loss_scaler.update(False)
            self.zero.params_updated()
            self._step_applied = True
            if self.client is not None:  # a client lr scheduler steps, as in DeepSpeed
                self.client.after_applied_step(self.get_lr())
        self._end_window()
        if refusal is not None:  # the engine goes on from a clean window if the caller catches it
            raise refusal
        dt = time.perf_counter() - t0
        self._timing["step_s"] += dt
        self._last["step_s"] = dt
        self._last_step = dict(self._last)
        self._last = {}
        report_step(self)  # steps_per_print / wall_clock_breakdown: [Note: progress at steps_per_print]

    def was_step_applied(self) -> bool:
        """True if the last `step()` updated the parameters: False inside an accumulation window
        and after an fp16 overflow (DeepSpeed's meaning)."""
        return self._step_applied

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last optimizer step. `step()` already zeroes
        them at every boundary (as DeepSpeed's), so a loop calling this after it is harmless. The
        model's own ``zero_grad()`` and the client optimizer's call this ([Note: zero_grad of the
        model])."""
        self._check_no_step_in_flight("zero_grad")
        self._end_window()

    def _end_window(self) -> None:
        """The accumulation window is over: its gradients and flags go."""
        self.zero.zero_grads()
        self._found_inf = False
        self._sq_norm_local = 0.0
        self._backward_since_step = False
        self.nonfinite.reset()

    def _any_rank(self, flag: bool) -> bool:
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            t = torch.tensor([1.0 if flag else 0.0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            return bool(t.item() > 0)
        return flag

    # ---- introspection ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """JSON-able: tiers (bytes, peaks, links, stalls), zero scheduling, optimizer pipeline,
        step timings, loss scale and step counters."""
        return {
            "tiers": self.tm.stats(),
            "zero": self.zero.stats(),
            "optimizer": self.optimizer.stats(),
            "timing": {"total": dict(self._timing), "last_step": dict(getattr(self, "_last_step", {}))},
            "capacity": self.capacity,
            "host_memory": self._host_memory(),
            "bytes_per_step": self._bytes_per_step(),
            "residency": self.residency.summary(),
            "loss_scale": self.loss_scale,
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "nonfinite_steps": self.nonfinite.steps_skipped,
            "micro_steps": self.micro_steps,
            "last_grad_norm": None
            if self.last_grad_norm is None or not math.isfinite(self.last_grad_norm)
            else self.last_grad_norm,
        }

    def _host_memory(self) -> dict[str, Any]:
        """The host peak the memory model promises for this run ([Note: one memory model]: the
        host tiers' need, the process baseline, the transients outside the tiers, the backends'
        buffers, the imports beyond the baseline), next to the process's peak RSS so far (``ru_maxrss``)."""
        import resource

        extra = self._host_extra
        tiers = sum(int(d["total"]) for t, d in self.capacity.items() if self._tier_memory.get(t) == "host")
        # the copies the host tiers keep across steps, inside their budgets ([Note: residency])
        tiers += sum(self.residency.bytes_in(t) for t, m in self._tier_memory.items() if m == "host")
        planned = tiers + int(extra.get("baseline", 0)) + int(extra.get("outside_tiers", 0))
        planned += sum(extra.get("backends", {}).values()) + int(extra.get("imports", 0))
        planned += int(extra.get("live", 0))  # the live budget's parameters where "gpu" is host memory
        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return {**extra, "tiers": tiers, "planned_peak_bytes": planned, "peak_rss_bytes": rss_kib * 1024}

    def _bytes_per_step(self) -> dict[str, Any]:
        """The floor of [Note: bytes per step] next to what the tier manager moved per step so far
        (every link's bytes since initialize, over the optimizer steps taken; the first step
        includes the moves of initialize's writes and the first gather)."""
        from tiered.planning.traffic import measured_per_step

        links = self.tm.stats().get("links", {})
        return {
            "formula": dict(self._traffic_floor),
            "measured": measured_per_step(links, self._tier_memory, self.global_steps)
            if self.global_steps
            else None,
            "steps": self.global_steps,
        }

    def state_dict_fp32(self) -> dict[str, torch.Tensor]:
        """Consolidated parameters (every rank's shard gathered), as the module names them."""
        self._check_open()
        self._check_no_step_in_flight("state_dict_fp32")
        return self.zero.gather_full_state_dict()

    def _check_no_step_in_flight(self, what: str) -> None:
        if self.optimizer.overlapped_step_running:
            raise RuntimeError(
                f"engine.{what}() between backward and step: with tiered.overlap_step_with_backward the "
                "optimizer step began in backward and is still updating parameters; call engine.step() first"
            )

    # ---- checkpoints: see [Note: checkpoint layout] in tiered/checkpoint/engine_state.py -----
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Write the full training state to ``<save_dir>/<tag>/`` (tag default ``global_step<N>``)
        atomically, then (`save_latest`) point ``<save_dir>/latest`` at it; returns the
        checkpoint's path. As DeepSpeed's: `client_state` is JSON plus tensors (those go into the
        safetensors file), `exclude_frozen_parameters` leaves out frozen parameters ([Note:
        checkpoint keywords]). Every rank calls it."""
        self._check_checkpoint_point("save_checkpoint")
        return self._persistence.save(
            save_dir,
            tag if tag is not None else f"global_step{self.global_steps}",
            client_state=client_state if client_state is not None else {},
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
            training=self._training_state(),
        )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str, Any]:
        """Restore the training state saved by `save_checkpoint` (tag None: the one ``latest``
        names) on any world size; returns ``(path, client_state)`` as DeepSpeed does, with
        DeepSpeed's keywords ([Note: checkpoint keywords]). A missing, half-written, corrupt or
        incompatible checkpoint raises (DeepSpeed returns None)."""
        from tiered.engine.ds_checkpoint import load_scope

        scope = load_scope(
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
            config_schedule=isinstance(self.lr_scheduler, ConfigLRScheduler),
        )
        self._check_checkpoint_point("load_checkpoint")
        path, manifest, client_state = self._persistence.load(load_dir, tag, scope)
        if scope.training_state:
            self._apply_training_state(manifest["training"], scope.optimizer_steps, scope.lr_scheduler)
        self.zero.params_updated()
        log.info("loaded checkpoint %s (global step %d)", path, self.global_steps)
        return path, client_state

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        dtype: torch.dtype = torch.bfloat16,
        max_shard_size: int | str = "5GB",
        tokenizer: Any = None,
    ) -> str:
        """The trained weights, consolidated, as a Hugging Face directory (config.json, safetensors
        shards, model.safetensors.index.json) that ``from_pretrained`` loads; streamed group by
        group (see [Note: streamed export]). Every rank calls it; rank 0 writes.

        `tokenizer`: a tokenizer object (its ``save_pretrained`` writes the files) or a folder
        whose tokenizer files are copied; None (the default) copies those of the folder the
        weights came from (`tokenizer_source`), False writes none ([Note: tokenizer files in the
        export]). A peft model exports its adapter in peft's format ([Note: exporting a peft
        model])."""
        self._check_open()
        self._check_no_step_in_flight("save_pretrained")
        return self._persistence.export(
            save_directory,
            dtype=dtype,
            max_shard_size=max_shard_size,
            tokenizer=self.tokenizer_source if tokenizer is None else tokenizer,
            base_model=self.tokenizer_source,
        )

    def gathered_parameters(self, params_or_module: Any, modify: bool = False) -> Any:
        """``with engine.gathered_parameters(module_or_params, modify=False):`` the parameters hold
        their full values inside; with `modify`, what they hold at exit is written back to every
        tier (and the fp32 master). See [Note: gathered parameters]. Every rank enters it."""
        self._check_open()
        self._check_no_step_in_flight("gathered_parameters")
        return self._persistence.gathered(params_or_module, modify)

    def _check_checkpoint_point(self, what: str) -> None:
        self._check_open()
        self._check_no_step_in_flight(what)
        if self._backward_since_step or self.micro_steps % self.gas:
            raise RuntimeError(
                f"engine.{what}() inside a gradient accumulation window (micro step {self.micro_steps}, "
                f"gradient_accumulation_steps={self.gas}): the accumulated gradients are not part of a "
                "checkpoint; call it after the engine.step() that ends the window"
            )

    def _training_state(self) -> dict[str, Any]:
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            # every group steps together: one bias-correction count; the lr schedule's position
            "optimizer_step": self.optimizer.step_count,
            "param_steps": self.optimizer.param_step_counts(),  # a parameter without grad is not stepped
            "scheduler": None if self.config.scheduler is None else self.config.scheduler.type,
            "loss_scaler": self.loss_scaler.state_dict(),
            **({} if self.client is None else self.client.training_state()),
        }

    def _apply_training_state(
        self, state: dict[str, Any], optimizer_steps: bool = True, lr_scheduler: bool = True
    ) -> None:
        self.global_steps = int(state["global_steps"])
        self.micro_steps = int(state["micro_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        if optimizer_steps:
            self.optimizer.load_step_counts(state["optimizer_step"], state.get("param_steps"))
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self.client is not None:
            self.client.apply_training_state(state, lr_scheduler=lr_scheduler)
        self.last_grad_norm = None
        self._found_inf = False
        self._sq_norm_local = 0.0
        self.nonfinite.reset()

    # ---- lifetime --------------------------------------------------------------------------
    def flush(self) -> None:
        """Finish every write-back in flight and write dirty copies to their homes."""
        self._check_open()
        self._check_no_step_in_flight("flush")
        self._wait_writes("engine.flush()")
        self.tm.flush().result()

    def _wait_writes(self, what: str) -> None:
        """The optimizer's write-backs in flight end; a full disk among their errors gets the
        way out said ([Note: a failed write-back is retried by flush])."""
        try:
            self.optimizer.wait_writes()
        except OSError as e:
            if not _is_enospc(e):
                raise
            raise StorageIOError(
                errno.ENOSPC,
                f"{e}. The disk is full; nothing is lost: the updated values stay in memory. Free "
                f"space there, call engine.flush() (it writes them home), then call {what} again",
            ) from e

    def close(self, restore_weights: bool = True) -> None:
        """Wait for the optimizer's write-backs in flight, give the module its trained weights
        back (`restore_weights`), remove the hooks, stop the tier manager and close its backends
        (offload swap files are deleted). A persistent tier of your own (``tiered.tiers``) is
        flushed first, so its files hold the final values; a flush that fails is logged and
        raised once the rest is closed. Idempotent.

        With `restore_weights` every parameter becomes an ordinary CPU tensor again holding its
        trained values in the compute dtype (gathered group by group; with several ranks a
        collective), so ``generate``, ``save_pretrained`` and plain PyTorch use just work. That
        is done group by group, each group's partitions leaving the tiers as its weights come back,
        so it needs one group more than the tiers held ([Note: restore at close group by
        group]); the module then holds the whole model in host memory: pass
        ``restore_weights=False`` for a model that does not fit there (its parameters then stay
        empty; export with `save_pretrained` first).
        A close from the garbage collector, or from a ``with`` block left by an exception,
        does not restore."""
        if self._closed:
            return
        self._closed = True
        restored = False
        flushed = False
        flush_error: Exception | None = None
        close_error: Exception | None = None
        try:
            self.optimizer.close()
            flush_error = self._persistence.flush_persistent_tiers()
            flushed = True
        finally:
            try:
                self.zero.remove_hooks()
                if restore_weights and flushed:  # [Note: restore at close group by group]
                    restored = self._persistence.restore_weights(flushed=flush_error is None)
            finally:
                trace_path = self.config.tiered.trace_path
                if trace_path:
                    try:
                        self.tm.write_trace(trace_path)
                    except Exception:
                        log.exception("could not write the trace to %s", trace_path)
                try:
                    self.tm.close()
                except Exception as e:  # noqa: BLE001 - a backend that would not close: raised below, once the weights are back
                    close_error = e
                finally:
                    unwatch_sigterm(self)  # [Note: SIGTERM from a library]
                    unmark_managed(self._module, self)
                    self._undo_zero_grad()
        if not restored:
            refuse_use_while_empty(self._module)
        if flush_error is not None:  # raised once the engine is closed all the same
            raise flush_error from close_error
        if close_error is not None:
            raise close_error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this tiered Engine is closed; create a new one with tiered.initialize")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's own error goes on: a failure to close (a flush) is logged, never over it
            self.close(restore_weights=False)
        except Exception:
            log.exception("closing the engine after an error in its `with` block failed as well")

    def __del__(self) -> None:  # a forgotten close must not leave the loop thread running
        try:
            if not self._closed:
                self.close(restore_weights=False)
        except Exception:  # noqa: BLE001
            pass
