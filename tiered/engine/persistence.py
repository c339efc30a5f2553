"""What outlives a step: checkpoints, the Hugging Face export, gathered access to full values,
and the weights given back at close, over one engine's partitions.

Lifetime: the engine's. `EnginePersistence` holds no state of its own, only the engine's parts
(config, tier manager, zero partitions, optimizer, placement, module, process group), so
`Engine` keeps its counters and its checks (a closed engine, a step in flight, an accumulation
window) and hands the I/O here: the checkpoint layout is [Note: checkpoint layout] in
tiered/checkpoint/engine_state.py.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from tiered.checkpoint.decode_load import register_moment_format
from tiered.errors import ParameterNotGatheredError
from tiered.optim.state_format import FORMATS
from tiered.zero.full_params import (
    export_order,
    gathered,
    iter_full_groups,
    restore_full_groups,
    take_piece_values,
)

if TYPE_CHECKING:
    from tiered.checkpoint.engine_state import Collective, GroupState
    from tiered.checkpoint.keywords import LoadScope
    from tiered.engine.parts import EngineParts
    from tiered.optim.loss_scaler import DynamicLossScaler, StaticLossScaler
    from tiered.zero.group import GroupRuntime

log = logging.getLogger(__name__)

# [Note: moment codecs registered from above] in tiered/checkpoint/decode_load.py: checkpoint reads
# without an engine (tiered.checkpoint.read_parameters) decode compressed moments with these.
for _name, _fmt in FORMATS.items():
    register_moment_format(_name, {"exp_avg": _fmt.exp_avg, "exp_avg_sq": _fmt.exp_avg_sq})


class EnginePersistence:
    """Checkpoint save/load, export and gathered parameters of one engine (see the module)."""

    def __init__(self, parts: EngineParts) -> None:
        self._module = parts.module
        self._config = parts.config
        self._tm = parts.tm
        self._zero = parts.zero
        self._optimizer = parts.optimizer
        self._placement = parts.placement
        self._rank = parts.rank
        self._world_size = parts.world_size
        self._process_group = parts.process_group
        self._hooks = parts.hooks

    # ---- checkpoints ---------------------------------------------------------------------------
    def groups(self) -> list[GroupState]:
        from tiered.checkpoint.engine_state import GroupState

        states = self._optimizer.checkpoint_partitions()
        return [GroupState(g, {"param": g.param, **states.get(g.name, {})}) for g in self._zero.groups]

    def collective(self) -> Collective:
        from tiered.checkpoint.engine_state import Collective

        return Collective(self._rank, self._world_size, self._process_group)

    def training_state(
        self, counters: dict[str, int], loss_scaler: StaticLossScaler | DynamicLossScaler
    ) -> dict[str, Any]:
        """The manifest's training section: the engine's `counters`, the optimizer's step counts,
        the loss scale and what the engine's hooks keep (a client scheduler's position)."""
        hooks = self._hooks
        return {
            **counters,
            # every group steps together: one bias-correction count; the lr schedule's position
            "optimizer_step": self._optimizer.step_count,
            "param_steps": self._optimizer.param_step_counts(),  # a parameter without grad is not stepped
            "scheduler": None if self._config.scheduler is None else self._config.scheduler.type,
            "loss_scaler": loss_scaler.state_dict(),
            **({} if hooks is None else hooks.training_state()),
        }

    def restore_training(
        self, training: dict[str, Any], loss_scaler: StaticLossScaler | DynamicLossScaler, scope: LoadScope
    ) -> None:
        """A loaded training section, the engine's counters aside (`scope`: [Note: checkpoint
        keywords])."""
        if scope.optimizer_steps:
            self._optimizer.load_step_counts(training["optimizer_step"], training.get("param_steps"))
        loss_scaler.load_state_dict(training["loss_scaler"])
        if self._hooks is not None:
            self._hooks.apply_training_state(training, lr_scheduler=scope.lr_scheduler)

    def save(
        self,
        save_dir: str | os.PathLike[str],
        tag: str,
        *,
        client_state: dict[str, Any],
        save_latest: bool,
        exclude_frozen_parameters: bool,
        training: dict[str, Any],
    ) -> str:
        """`Engine.save_checkpoint`'s writing: `training` is the engine's counters."""
        from tiered.checkpoint.engine_state import check_json, parameter_specs, save_engine_state
        from tiered.checkpoint.keywords import split_client_state
        from tiered.config.dump import dump_config

        json_state, tensors = split_client_state(client_state)
        check_json(json_state)
        self._optimizer.wait_writes()  # (their errors surface here, not inside the save)
        groups = self.groups()
        if exclude_frozen_parameters:
            groups = [gs for gs in groups if gs.group.trainable]
        body = {
            "config": dump_config(self._config),
            "compute_dtype": str(self._placement.compute_dtype),
            "optimizer_state_format": self._optimizer.fmt.name,  # [Note: compressed optimizer state]
            "training": training,
            "client_state": json_state,
            "frozen_excluded": bool(exclude_frozen_parameters),
            "parameter_specs": parameter_specs(groups),
        }
        return save_engine_state(
            self._tm,
            groups,
            save_dir,
            tag,
            body=body,
            comm=self.collective(),
            save_latest=save_latest,
            extra_tensors=tensors if self._rank == 0 else None,
        )

    def load(
        self, load_dir: str | os.PathLike[str], tag: str | None, scope: LoadScope
    ) -> tuple[str, dict[str, Any], Any]:
        """`Engine.load_checkpoint`'s reading: the partitions `scope` keeps are restored; returns
        (path, manifest, client_state). The engine applies the manifest's counters."""
        from tiered.checkpoint.engine_state import (
            GroupState,
            check_compatible,
            load_engine_state,
            open_checkpoint,
            parameter_specs,
            read_rank_tensors,
        )
        from tiered.checkpoint.keywords import join_client_state, tensor_names
        from tiered.config.dump import dump_config
        from tiered.optim.state_format import check_state_format_loads

        self._optimizer.wait_writes()
        path, manifest = open_checkpoint(load_dir, tag)
        groups = self.groups()
        if manifest.get("frozen_excluded"):
            groups = [gs for gs in groups if gs.group.trainable]
        check_compatible(
            manifest,
            parameter_specs(groups),
            str(self._placement.compute_dtype),
            dump_config(self._config),
            path,
        )
        groups = [GroupState(gs.group, scope.keep(gs.parts)) for gs in groups]
        decode = None  # [Note: compressed optimizer state]: bf16/int8 moments decoded into an fp32 run
        if any("exp_avg" in gs.parts for gs in groups):
            decode = check_state_format_loads(manifest, self._optimizer.fmt.name, path)
        load_engine_state(self._tm, groups, path, manifest, comm=self.collective(), decode=decode)
        saved = manifest.get("client_state")
        client = join_client_state(saved, read_rank_tensors(path, manifest, 0, tensor_names(saved)))
        return path, manifest, client

    # ---- exports and full values ---------------------------------------------------------------
    def export(
        self,
        save_directory: str | os.PathLike[str],
        *,
        dtype: torch.dtype,
        max_shard_size: int | str,
        tokenizer: Any,
        base_model: str | None,
    ) -> str:
        """`Engine.save_pretrained`'s writing ([Note: streamed export]); rank 0 writes."""
        from tiered.checkpoint.export import is_peft_model, save_peft_adapter, save_pretrained

        self._optimizer.wait_writes()
        if is_peft_model(self._module):
            out = save_peft_adapter(
                self._module,
                self.gathered,
                save_directory,
                dtype=dtype,
                writer=self._rank == 0,
                base_model=base_model,
                tokenizer=tokenizer,
            )
        else:
            out = save_pretrained(
                self._module,
                iter_full_groups(self._zero),
                export_order(self._zero),
                save_directory,
                dtype=dtype,
                max_shard_size=max_shard_size,
                writer=self._rank == 0,
                tokenizer=tokenizer,
                file_layout=self._file_layout(),
            )
        self.collective().barrier()
        return out

    def _file_layout(self) -> Any:
        """The names transformers' save_pretrained gives the module's tensors ([Note: file tensors
        by transformers' conversions]), or None where they are the module's own."""
        from tiered.checkpoint.export import persistent_buffers
        from tiered.zero.conversions import export_layout

        named = [(e.name, e.shape) for g in self._zero.groups for e in g.entries if e.start == 0]
        named += [(n, tuple(b.shape)) for n, b in persistent_buffers(self._module)]
        return export_layout(self._module, named)

    def gathered(self, params_or_module: Any, modify: bool = False) -> Any:
        """[Note: gathered parameters]: a context manager; every rank enters it."""
        from tiered.checkpoint.gathered import gathered_parameters, parameters_of

        return gathered_parameters(
            self._zero,
            self._tm,
            self._optimizer.checkpoint_partitions(),
            parameters_of(params_or_module),
            modify=modify,
            world_size=self._world_size,
            process_group=self._process_group,
            gather=lambda ps: gathered(self._zero, ps),
            pull=lambda groups: take_piece_values(self._zero, groups),
        )

    # ---- at close ------------------------------------------------------------------------------
    def restore_weights(self, *, flushed: bool = True) -> bool:
        """Point every parameter of the module at its full value in the compute dtype, on the
        CPU, group by group, each group's partitions dropped from the tiers as its weights come
        back ([Note: restore at close group by group]; a collective with several ranks). False
        (logged) when they cannot all be gathered (a broken model, a failed backward): the close
        goes on all the same, the groups not restored left empty. Only at close: the engine
        cannot run after it. `flushed`: the persistent tiers hold the final values (their copies
        in memory may go; after a failed flush they stay)."""
        own = {og.group.name: og.own_partitions() for og in self._optimizer.groups}

        def free(rt: GroupRuntime) -> None:
            g = rt.group
            parts = [g.param, g.grad, rt.full_part, *own.get(g.name, ())]
            for p in {id(p): p for p in parts if p is not None}.values():
                if self._persists(p.home):  # its home keeps the final values, once flushed
                    copies = [t for t in self._tm.tier_names if t != p.home and p.is_resident(t)]
                    for f in [self._tm.evict(p, t) for t in copies] if flushed else []:
                        f.result()
                else:
                    self._tm.drop(p).result()
            rt.forget_home_views()  # the last references to the dropped home tensors
            for t in self._tm.tier_names:  # a pool would keep the dropped bytes for a reuse
                self._tm.tier(t).backend.release_cached()

        try:
            restore_full_groups(self._zero, free)
        except Exception as e:  # noqa: BLE001 - a broken model or a failed backward: still close
            log.warning(
                "close(): some of the module's parameters stay empty, their weights could not be gathered back: %s",
                e,
            )
            return False
        return True

    def flush_persistent_tiers(self) -> Exception | None:
        """Write home the dirty copies of partitions whose home outlives the process (a tier the
        user declared: its files must hold the trained values after close); swap tiers are
        deleted anyway. Returns the error, logged, of a flush that failed."""
        parts = [p for g in self._zero.groups for p in (g.param, g.grad) if p is not None]
        parts += self._optimizer.own_partitions()
        todo = [p for p in {id(p): p for p in parts}.values() if self._persists(p.home)]
        if not todo:
            return None
        try:
            for f in [self._tm.flush(p) for p in todo]:
                f.result()
        except Exception as e:  # noqa: BLE001 - returned, raised at the end of close
            log.error(
                "close(): the persistent tier(s) %s do not hold the final values: %s",
                sorted({p.home for p in todo}),
                e,
            )
            return e
        log.debug("close(): flushed %d partitions to persistent tiers", len(todo))
        return None

    def _persists(self, tier: str) -> bool:
        caps = self._tm.tier(tier).backend.capabilities
        return bool(caps.persistent) and not caps.memory_like


def refuse_use_while_empty(module: torch.nn.Module) -> None:
    """After a close that gave no weights back, a forward of `module` (its parameters are empty
    tensors) is a clear error, not a shape error deep inside; the guard goes once weights are
    assigned again."""
    if not any(p.numel() == 0 for p in module.parameters()):
        return
    name = type(module).__name__

    def guard(mod: torch.nn.Module, args: Any) -> None:
        if not any(p.numel() == 0 for p in mod.parameters()):
            handle.remove()
            return
        raise ParameterNotGatheredError(
            f"{name} was closed by a tiered Engine without getting its weights back "
            "(close(restore_weights=False), a close by the garbage collector, or a `with` block left "
            "by an exception): its parameters are empty. Load weights into it (e.g. from the folder "
            "engine.save_pretrained wrote), or close with restore_weights=True"
        )

    handle = module.register_forward_pre_hook(guard)
