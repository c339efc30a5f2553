"""Hugging Face's Trainer (and TRL's trainers, which subclass it) on tiered's engine.

    from tiered.integrations.hf import TieredTrainer
    trainer = TieredTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            tiered_config="ds_config.json")
    trainer.train()                       # or: tiered_trainer(SFTTrainer)(..., tiered_config=...)

[Note: where tiered plugs into the Trainer]
The places transformers' DeepSpeed integration plugs in, taken over one by one (`TieredTrainerMixin`):

- ``create_optimizer`` builds the engine as ``tiered.deepspeed`` does (``initialize_with_client``
  with the Trainer's param groups: a `DeepSpeedEngine` and its optimizer facade), the config's
  "auto" filled from TrainingArguments exactly as ``HfTrainerDeepSpeedConfig.trainer_config_process``
  / ``trainer_config_finalize`` do (lr, betas, eps, weight decay, warmup and total steps, micro
  batch, accumulation, clipping, fp16/bf16: tiered.initialize's hyper-parameter keywords, whose
  mismatch rule is HF's: a config value that contradicts the Trainer's is refused, naming both).
  As in HF: with an ``optimizer`` section the model's trainable parameters go in one group; without
  one, the Trainer's optimizer is AdamW with its no-decay groups (``get_decay_parameter_names``),
  so ``args.optim`` must be an AdamW. The Trainer's ``self.optimizer`` is the engine's facade
  ([Note: the optimizer facade]).
- ``create_scheduler``: with a ``scheduler`` section the engine drives the lr and the Trainer gets
  a scheduler that only mirrors it; without one, the Trainer's own (``lr_scheduler_type``) is built
  on the facade and drives the lr through its param groups, as accelerate's DeepSpeed wrapper does.
- ``training_step`` runs forward, ``engine.backward(loss, scale_wrt_gas=False)`` (the Trainer has
  divided the loss already, as with DeepSpeed) and ``engine.step()``, which steps at the
  accumulation boundary with the config's clipping (max_grad_norm); the Trainer's own
  ``optimizer.step()`` is then a no-op and ``_clip_grad_norm`` reports the engine's norm.
- ``save_model`` writes the real weights with ``engine.save_pretrained`` (the compute dtype);
  ``_save_optimizer_and_scheduler`` writes ``engine.save_checkpoint`` into the Trainer's
  checkpoint folder (tag ``tiered``), which ``resume_from_checkpoint`` loads back through
  ``engine.load_checkpoint`` (weights, optimizer state, lr schedule: bit-exact), the Trainer
  restoring its own state and RNG around it.
- The model is never moved to the device by the Trainer (``_move_model_to_device``): tiered
  places every parameter in its tier.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from tiered.config.loader import read_config_file
from tiered.config.schema import TieredConfig
from tiered.deepspeed.client import initialize_with_client
from tiered.deepspeed.engine_api import DeepSpeedEngine
from tiered.errors import CheckpointNotFoundError, ConfigError, UnsupportedConfigError

log = logging.getLogger(__name__)

__all__ = ["TieredTrainer", "TieredTrainerMixin", "tiered_trainer", "trainer_hyperparameters"]

CHECKPOINT_TAG = "tiered"
# args.optim values that are torch's AdamW (what tiered's offloaded Adam computes)
_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf")


def _raw(config: Any) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    if isinstance(config, dict):
        return config
    if isinstance(config, TieredConfig):
        from tiered.config.dump import dump_config

        return dump_config(config)
    raise ConfigError(
        f"tiered_config must be a dict, a JSON path or a TieredConfig, got {type(config).__name__}"
    )


def trainer_hyperparameters(args: Any, num_training_steps: int, *, has_scheduler: bool) -> dict[str, Any]:
    """tiered.initialize's keywords from TrainingArguments, as HF fills a DeepSpeed config."""
    if args.fp16:
        precision = "fp16"
    elif args.bf16:
        precision = "bf16"
    else:
        precision = "no"
    hp: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "micro_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_grad_norm": args.max_grad_norm,
        "mixed_precision": precision,
    }
    if has_scheduler:  # the config's schedule takes HF's warmup and total steps
        hp["warmup_steps"] = args.get_warmup_steps(num_training_steps)
        hp["total_steps"] = num_training_steps
    return hp


class _MirrorEngineLR(torch.optim.lr_scheduler.LRScheduler):
    """The Trainer's scheduler when the config's ``scheduler`` drives the lr: stepping it keeps the
    lrs the engine wrote into the facade's groups."""

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [float(g["lr"]) for g in self.optimizer.param_groups]


class TieredTrainerMixin:
    """Put before a `transformers.Trainer` subclass; see [Note: where tiered plugs into the Trainer]."""

    args: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    processing_class: Any

    def __init__(self, *args: Any, tiered_config: Any, **kwargs: Any) -> None:
        self.tiered_config = tiered_config
        self.engine: DeepSpeedEngine | None = None
        self._tiered_max_steps: int | None = None
        super().__init__(*args, **kwargs)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        pass  # tiered places every parameter in its tier

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        gas = self.args.gradient_accumulation_steps
        if hasattr(train_dataloader, "__len__") and len(train_dataloader) % gas:
            raise ConfigError(
                f"the epoch has {len(train_dataloader)} batches, not a multiple of gradient_accumulation_steps "
                f"({gas}): the Trainer would step on a short last window, tiered's engine steps every {gas} "
                "micro-batches; use dataloader_drop_last or a dataset size that divides"
            )
        self._tiered_max_steps = max_steps
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)  # type: ignore[misc]

    # ---- the engine, its optimizer and scheduler ---------------------------------------------------
    def create_optimizer(self, model: Any = None) -> Any:
        if self.engine is not None:
            return self.optimizer
        if self._tiered_max_steps is None:
            raise RuntimeError("TieredTrainer builds its engine in train(); call trainer.train()")
        raw = _raw(self.tiered_config)
        hp = trainer_hyperparameters(
            self.args, self._tiered_max_steps, has_scheduler=raw.get("scheduler") is not None
        )
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if raw.get("optimizer") is not None:
            groups: Any = [p for _, p in trainable]
        else:
            optim = str(getattr(self.args.optim, "value", self.args.optim))
            if optim not in _ADAMW_OPTIMS:
                raise UnsupportedConfigError(
                    f"TrainingArguments.optim={optim!r}: the config has no optimizer section, so the Trainer's "
                    f"optimizer would be used, and tiered offloads AdamW only ({', '.join(_ADAMW_OPTIMS)}); "
                    'set optim="adamw_torch" or add an optimizer section'
                )
            decay = set(self.get_decay_parameter_names(self.model))  # type: ignore[attr-defined]
            groups = [
                {"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
        engine, facade, _, _ = initialize_with_client(
            self.model, self.tiered_config, model_parameters=groups, **hp
        )
        self.engine = engine
        self.optimizer = facade
        return facade

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.lr_scheduler is None:
            assert self.engine is not None
            if self.engine.config.scheduler is not None:
                self.lr_scheduler = _MirrorEngineLR(optimizer or self.optimizer)
            else:
                return super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]
        return self.lr_scheduler

    # ---- one micro-batch -----------------------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        engine = self.engine
        assert engine is not None
        model.train()
        inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
        with self.compute_loss_context_manager():  # type: ignore[attr-defined]
            loss: torch.Tensor = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)  # type: ignore[attr-defined]
        scaled_for_ga = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled_for_ga is None:
            scaled_for_ga = (
                getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
            ) or getattr(self, "compute_loss_func", None) is not None
        if not scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps  # type: ignore[attr-defined]
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: Any) -> Any:
        assert self.engine is not None
        return self.engine.get_global_grad_norm()  # the engine clipped (gradient_clipping)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return grad_norm

    def _get_learning_rate(self) -> float:
        # What HF logs on DeepSpeed: a config scheduler has stepped inside the engine's step by the
        # time the Trainer reads the lr, so the log shows its get_last_lr() after the step; the
        # Trainer's own scheduler is read before the Trainer steps it (the lr the step used).
        engine = self.engine
        if engine is not None and engine.config.scheduler is not None and engine.lr_scheduler is not None:
            return float(engine.lr_scheduler.get_last_lr()[0])
        lr: float = super()._get_learning_rate()  # type: ignore[misc]
        return lr

    # ---- saving and resuming -------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.engine is None:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        dtype = self.engine.placement.compute_dtype
        self.engine.save_pretrained(output_dir, dtype=dtype)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            from transformers.trainer import TRAINING_ARGS_NAME

            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        assert self.engine is not None
        # the Trainer's scheduler steps outside the engine: its position travels as client state
        sched = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        self.engine.save_checkpoint(
            output_dir, tag=CHECKPOINT_TAG, save_latest=False, client_state={"lr_scheduler": sched}
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # the weights come back with the engine's checkpoint (_load_optimizer_and_scheduler)
        path = os.path.join(resume_from_checkpoint, CHECKPOINT_TAG)
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(
                f"{resume_from_checkpoint} holds no tiered engine checkpoint ({CHECKPOINT_TAG}/): it was not "
                "written by TieredTrainer; resume from a checkpoint folder TieredTrainer saved"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        assert self.engine is not None
        self._load_from_checkpoint(checkpoint)
        _, client_state = self.engine.load_checkpoint(checkpoint, tag=CHECKPOINT_TAG)
        sched = (client_state or {}).get("lr_scheduler")
        if sched is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(sched)
            for g, lr in zip(
                self.lr_scheduler.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True
            ):
                g["lr"] = lr


def tiered_trainer(base: type) -> type:
    """`base` (a transformers.Trainer subclass: TRL's SFTTrainer, DPOTrainer, ...) on tiered's
    engine: ``tiered_trainer(SFTTrainer)(..., tiered_config=...)``."""
    return type(f"Tiered{base.__name__}", (TieredTrainerMixin, base), {"__module__": __name__})


def _trainer_base() -> type:
    try:
        from transformers import Trainer
    except ImportError as e:  # the hf extra
        raise ImportError("tiered.integrations.hf needs transformers: pip install 'tiered[hf]'") from e
    return Trainer


TieredTrainer = tiered_trainer(_trainer_base())
