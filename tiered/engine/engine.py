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

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from tiered.engine.inputs import cast_floating, check_inputs, check_loss, input_dtype_error
from tiered.engine.lifetime import close_parts, unmark_managed, wait_writes
from tiered.engine.nonfinite import NonFiniteGuard
from tiered.engine.parts import Part, bytes_per_step_stats, host_memory_stats
from tiered.engine.persistence import EnginePersistence
from tiered.engine.progress import report_step
from tiered.engine.signals import unwatch as unwatch_sigterm
from tiered.engine.step_state import StepState, StepTimes
from tiered.engine.zero_grad import redirect_zero_grad
from tiered.optim.arrivals import grads_consumed_from_memory, overlap_step_applies
from tiered.optim.clip import clip_coefficient, global_grad_norm
from tiered.optim.loss_scaler import build_loss_scaler
from tiered.zero.comm import any_rank

if TYPE_CHECKING:
    from tiered.checkpoint.keywords import LoadScope
    from tiered.config.schema import TieredConfig
    from tiered.engine.parts import EngineParts
    from tiered.optim.offload import OffloadedAdam
    from tiered.optim.schedulers import LRSchedule
    from tiered.planning.homes import Placement
    from tiered.planning.needs import TierNeed
    from tiered.planning.residency import Residency
    from tiered.shards import ShardGroup
    from tiered.tiers import TierManager
    from tiered.zero import ZeroParameters

log = logging.getLogger(__name__)


class Engine:
    """Forward, backward, step, stats, save and close over one frozen `EngineParts`.

    Built by `tiered.initialize` (tiered/engine/build.py); see [Note: engine step semantics]. Its
    own state is the per-step `StepState` and `StepTimes` (tiered/engine/step_state.py), the loss
    scaler and the non-finite guard. DeepSpeed's engine API (train, eval, state_dict, the config
    accessors, ...) is an adapter around it: `tiered.deepspeed.engine_api.DeepSpeedEngine`.
    """

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        cfg = parts.config
        self._persistence = EnginePersistence(parts)
        """Checkpoints, exports and full values over these partitions (tiered/engine/persistence.py)."""
        self.loss_scaler = build_loss_scaler(cfg.precision)
        self.gas = int(cfg.gradient_accumulation_steps)
        self._state = StepState()
        self._times = StepTimes()
        self._closed = False
        # Only clipping and the fp16 overflow check need the gradient norm; otherwise the pass
        # reading every gradient once more is skipped (on a 40B model: 160 GB read per step) and
        # ``last_grad_norm`` reports None.
        self._needs_grad_norm = float(cfg.gradient_clipping) > 0 or cfg.precision.dtype == torch.float16
        self.nonfinite = NonFiniteGuard(cfg, parts.zero, norm_computed=self._needs_grad_norm)
        self.overlap_step = overlap_step_applies(cfg)
        if self.overlap_step:
            parts.zero.on_group_grads_complete(self._group_grads_complete)
        if grads_consumed_from_memory(cfg):  # [Note: gradient consumed from memory] in tiered/optim/group.py
            parts.zero.keep_flushed_grads(keeper=parts.optimizer.keep_grads_in_memory())
        # the model's own zero_grad reaches the engine: [Note: zero_grad of the model]
        self._undo_zero_grad = redirect_zero_grad(parts.module, self)

    # ---- the parts, by name ----------------------------------------------------------------
    module: Part[torch.nn.Module] = Part()
    config: Part[TieredConfig] = Part()
    tm: Part[TierManager] = Part()
    zero: Part[ZeroParameters] = Part()
    optimizer: Part[OffloadedAdam] = Part()
    placement: Part[Placement] = Part()
    scheduler: Part[LRSchedule] = Part()
    process_group: Part[Any] = Part()
    world_size: Part[int] = Part()
    rank: Part[int] = Part()
    capacity: Part[dict[str, TierNeed]] = Part()
    tokenizer_source: Part[str | None] = Part()
    residency: Part[Residency] = Part()

    # ---- the step counters ([Note: engine step semantics]) -----------------------------------
    @property
    def micro_steps(self) -> int:
        return self._state.micro_steps

    @property
    def global_steps(self) -> int:
        return self._state.global_steps

    @property
    def skipped_steps(self) -> int:
        return self._state.skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        return self._state.last_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def get_lr(self) -> list[float]:
        """The lr the next optimizer step will use (a list per param group, as DeepSpeed)."""
        base = self._base_lr()
        return [base * s for s in self.parts.lr_scales]

    def _base_lr(self) -> float:
        """The lr handed to the optimizer (per-group lrs are multiples of it)."""
        return float(self.parts.scheduler.lr_at(self.optimizer.step_count))

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._state.at_boundary(self.gas)

    def was_step_applied(self) -> bool:
        """True if the last `step()` updated the parameters: False inside an accumulation window
        and after an fp16 overflow (DeepSpeed's meaning)."""
        return self._state.step_applied

    # ---- the training loop -----------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        t0 = time.perf_counter()
        if self.config.precision.auto_cast and self.config.precision.dtype == torch.float16:  # fp16.auto_cast
            args, kwargs = cast_floating(args, torch.float16), cast_floating(kwargs, torch.float16)
        module = self.parts.module
        check_inputs(module, args, kwargs)
        try:
            out = module(*args, **kwargs)
        except RuntimeError as e:
            clear = input_dtype_error(e, module, self.placement.compute_dtype, args, kwargs)
            if clear is None:
                raise
            raise clear from e
        dt = time.perf_counter() - t0
        self._times.add("forward_s", dt)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """loss / gas (x loss scale in fp16), autograd, then flush the gradients to their tier.

        As DeepSpeed's: `retain_graph` goes to autograd; ``scale_wrt_gas=False`` skips the division
        by gradient_accumulation_steps (for a loss already divided, as Hugging Face's Trainer does)."""
        self._check_open()
        check_loss(loss)
        t0 = time.perf_counter()
        scaled = loss.float() if loss.dtype != torch.float32 else loss
        if self.gas != 1 and scale_wrt_gas:
            scaled = scaled / self.gas
        if self.loss_scaler.scale != 1.0:
            scaled = scaled * self.loss_scaler.scale
        micro = self._state.micro_steps % self.gas + 1  # [Note: non-finite steps]
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
        self._state = self._state.after_backward(
            found_inf=bool(summary.found_inf), sq_norm_local=float(summary.sq_norm_local)
        )
        dt = time.perf_counter() - t0
        self._times.add("backward_s", dt)

    def _group_grads_complete(self, group: ShardGroup) -> None:
        if self.optimizer.overlapped_step_running:  # (frozen groups never flush)
            self.zero.seal_for_step(group)
            self.optimizer.group_ready(group)

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary run (or skip) the optimizer step."""
        self._check_open()
        if self._state.window.backward_seen and self._state.at_boundary(self.gas):
            # the last step's write-backs end first: one that failed (a full disk) raises here,
            # before anything of this step is done, so after `flush()` with space freed the same
            # call goes on ([Note: a failed write-back is retried by flush])
            wait_writes(self.optimizer, "engine.step()")
        state = self._state = replace(
            self._state, micro_steps=self._state.micro_steps + 1, step_applied=False
        )
        if state.micro_steps % self.gas != 0:
            return
        if not state.window.backward_seen:
            raise RuntimeError(
                "engine.step() at an accumulation boundary without engine.backward(loss) first"
            )
        t0 = time.perf_counter()
        state = self._state = replace(state, global_steps=state.global_steps + 1)
        overflow = any_rank(
            state.window.found_inf or self.nonfinite.seen, self.world_size, self.process_group
        )
        scale = self.loss_scaler.scale
        refusal: Exception | None = None
        if overflow and self.nonfinite.active:  # bf16/fp32: [Note: non-finite steps]
            self._state = replace(state, skipped_steps=state.skipped_steps + 1, last_grad_norm=float("nan"))
            applied = self.optimizer.overlapped_step_running
            if applied:
                self.optimizer.finish_overlapped_step()  # (what began in backward ends either way)
                self.zero.params_updated()
            refusal = self.nonfinite.refuse_step(state.global_steps, applied=applied)
        elif overflow and self.config.precision.dtype == torch.float16:
            self._state = replace(state, skipped_steps=state.skipped_steps + 1)
            self.loss_scaler.update(True)
            log.info(
                "fp16 overflow at step %d: step skipped, loss scale %g -> %g",
                state.global_steps,
                scale,
                self.loss_scaler.scale,
            )
            self._state = replace(self._state, last_grad_norm=float("inf"))
        else:
            norm = (
                global_grad_norm(state.window.sq_norm_local, process_group=self.process_group) / scale
                if self._needs_grad_norm
                else float("nan")
            )
            self._state = replace(state, last_grad_norm=norm)
            coef = clip_coefficient(norm, float(self.config.gradient_clipping))
            lr = self._base_lr()
            t1 = time.perf_counter()
            if self.optimizer.overlapped_step_running:  # begun in backward with coef 1, scale 1
                self.optimizer.finish_overlapped_step()
            else:
                self.optimizer.step(lr, coef / scale)
            self._times.total["optimizer_s"] += time.perf_counter() - t1
            self.loss_scaler.update(False)
            self.zero.params_updated()
            self._state = replace(self._state, step_applied=True)
            if self.parts.hooks is not None:  # a client lr scheduler steps, as in DeepSpeed
                self.parts.hooks.after_applied_step(self.get_lr())
        self._end_window()
        if refusal is not None:  # the engine goes on from a clean window if the caller catches it
            raise refusal
        self._times.step_done(time.perf_counter() - t0)
        report_step(
            self, self._times.last_step
        )  # steps_per_print / wall_clock_breakdown: [Note: progress at steps_per_print]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last optimizer step. `step()` already zeroes
        them at every boundary (as DeepSpeed's), so a loop calling this after it is harmless. The
        model's own ``zero_grad()`` calls this ([Note: zero_grad of the model])."""
        self._check_no_step_in_flight("zero_grad")
        self._end_window()

    def _end_window(self) -> None:
        """The accumulation window is over: its gradients and flags go."""
        self.zero.zero_grads()
        self._state = self._state.window_ended()
        self.nonfinite.reset()

    # ---- introspection ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """JSON-able: tiers (bytes, peaks, links, stalls), zero scheduling, optimizer pipeline,
        step timings, loss scale and step counters."""
        return {
            "tiers": self.tm.stats(),
            "zero": self.zero.stats(),
            "optimizer": self.optimizer.stats(),
            "timing": self._times.stats(),
            "capacity": self.capacity,
            "host_memory": host_memory_stats(self.parts),
            "bytes_per_step": bytes_per_step_stats(self.parts, self.global_steps),
            "residency": self.residency.summary(),
            "loss_scale": self.loss_scale,
            **self._state.stats(),
            "nonfinite_steps": self.nonfinite.steps_skipped,
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
            training=self._persistence.training_state(self._state.counters(), self.loss_scaler),
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
        from tiered.checkpoint.keywords import load_scope

        scope = load_scope(
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
            config_schedule=self.parts.config_schedule,
        )
        self._check_checkpoint_point("load_checkpoint")
        path, manifest, client_state = self._persistence.load(load_dir, tag, scope)
        if scope.training_state:
            self._apply_training_state(manifest["training"], scope)
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
        if self._state.window.backward_seen or self.micro_steps % self.gas:
            raise RuntimeError(
                f"engine.{what}() inside a gradient accumulation window (micro step {self.micro_steps}, "
                f"gradient_accumulation_steps={self.gas}): the accumulated gradients are not part of a "
                "checkpoint; call it after the engine.step() that ends the window"
            )

    def _apply_training_state(self, training: dict[str, Any], scope: LoadScope) -> None:
        self._state = self._state.restored(training)
        self._persistence.restore_training(training, self.loss_scaler, scope)
        self.nonfinite.reset()

    # ---- lifetime --------------------------------------------------------------------------
    def flush(self) -> None:
        """Finish every write-back in flight and write dirty copies to their homes."""
        self._check_open()
        self._check_no_step_in_flight("flush")
        wait_writes(self.optimizer, "engine.flush()")
        self.tm.flush().result()

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
        try:
            closed = close_parts(self.parts, self._persistence, restore_weights=restore_weights)
        finally:
            unwatch_sigterm(self)  # [Note: SIGTERM from a library]
            unmark_managed(self.parts.module, self)
            self._undo_zero_grad()
            if self.parts.hooks is not None:
                self.parts.hooks.closed()
        closed.finish(self.parts.module)

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
