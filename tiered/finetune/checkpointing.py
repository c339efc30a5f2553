"""Checkpoints of a fine-tuning run: periodic saves, pruning, resume, save on SIGINT/SIGTERM and
the final export. `CheckpointPolicy` is what `tiered finetune --out DIR` hands the loop.

[Note: run directory]
``--out DIR`` holds ``DIR/checkpoints/<tag>/`` (engine.save_checkpoint, tag ``global_step<N>``,
``latest`` naming the newest) and, when the run completes, ``DIR/final/``: engine.save_pretrained
in the compute dtype (fp32 runs export fp32, so the export holds exactly the trained weights)
plus the model folder's tokenizer files; with LoRA the adapter in peft's format instead
(adapter_config.json + adapter_model.safetensors) and, with ``--merge-lora``, the merged model
in ``DIR/final/merged/``. Each checkpoint's client_state carries the data position
(`PackedBatches.state_dict`, [Note: batch order and its state]); the engine restores everything
else (counters, optimizer, loss scaler, lr position, RNG states), so a resumed run is bit for bit
the run that was never stopped. ``--keep-last K`` prunes as [Note: pruning checkpoints] says. An
``--out`` whose ``checkpoints/`` holds anything is refused unless ``--resume`` (continue that run)
or ``--overwrite`` (delete ``DIR/checkpoints`` and ``DIR/final`` once every other check passed,
then start afresh): starting afresh beside another run's checkpoints would let a later
``--resume`` continue the other run. A ``checkpoints`` or ``final`` there that is not a folder (a
file, a FIFO, a dangling link) is refused before the model is built, and a run holds ``DIR`` for
its whole length ([Note: one run per folder]). ``--trace``, ``--plot`` and ``--stats-json`` may name files
inside ``DIR``; their folders are created with it.

[Note: pruning checkpoints]
``--keep-last K`` deletes the oldest complete checkpoints only after a newer one is complete
(save_checkpoint returned: renamed into place and ``latest`` moved), and only what this run can
tell it wrote: a real folder (no symlink) owned by this user whose manifest reads back (its
checksum, [Note: manifest checksum]) and names the folder's own tag. Anything else in
``checkpoints/`` (a foreign symlink, a copied checkpoint, a user's folder) is skipped, neither
counted nor deleted. Nothing is deleted unless ``latest`` names one of the K kept checkpoints and
each kept one verifies (manifest checksum, every listed file a regular file of its recorded
size), and never the one ``latest`` names.

[Note: stop on a signal]
With a run directory, the first SIGINT or SIGTERM only asks the loop to stop: the step in
progress finishes (a checkpoint is only possible at an accumulation boundary), a checkpoint is
saved, the engine closes and the command exits with 128 + the signal number. So the time to
exit is bounded by one optimizer step plus one save. A second signal raises KeyboardInterrupt at
once (nothing saved; the previous checkpoint stays valid, see [Note: atomic checkpoint]).
``--no-save-on-interrupt`` leaves the signals alone: Ctrl-C stops without saving, as before.
Under torchrun the ranks agree after every step whether any of them was asked to stop (one
1-element all-reduce of the signal number), so a signal that reaches one rank, or the ranks at
different steps, stops them all after the same step with one checkpoint (not a save one rank
waits in while the other trains on), and every rank exits with 128 + that signal. A signal sent
to every rank may reach one only after the save, while it reports or exits: the default action
would kill it (exit -15, not 128 + 15) and torchrun would then kill the other ranks mid-exit. So
once stopped the handlers stay installed (a late first signal is only logged), and from the
interpreter's exit on (an atexit hook) the signals are ignored: its shutdown resets Python
handlers to the default action, but not SIG_IGN. Only rank 0 deletes pruned checkpoints and
writes the LoRA adapter and the merged model (every rank gathers; [Note: ranks in finetune]).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from tiered.checkpoint.export import TOKENIZER_FILES, write_tokenizer
from tiered.config.user_files import kind_of
from tiered.errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
FINAL = "final"
MERGED = "merged"
DATA_STATE = "data"
# What the export copies from the model folder ([Note: tokenizer files in the export]).
TOKENIZER_EXPORT_FILES = TOKENIZER_FILES


class StopRequest:
    """The signal handlers of [Note: stop on a signal], installed while the loop runs."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first signal this process received."""
        self.decided: int | None = None
        """The signal that stopped the run: this process's or, under torchrun, another rank's."""
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_signal(self) -> int | None:
        """The signal the command reports as its exit status (128 + it), if one stopped it."""
        return self.decided if self.decided is not None else self.signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once")
        self.signum = signum
        if self.decided is not None:  # another rank's signal already stopped the run
            log.warning(
                "%s: already stopping (the checkpoint is saved or being saved)", signal.Signals(signum).name
            )
            return
        log.warning(
            "%s: saving a checkpoint after the step in progress, then stopping (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.exit_signal is not None and exc[0] is None and self._previous:
            # stopped (saved, engine closed): keep handling while the command reports, and
            # ignore the signals from the interpreter's exit on ([Note: stop on a signal])
            atexit.register(_ignore_stop_signals, self.SIGNALS)
            self._previous.clear()
            return
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


def _ignore_stop_signals(signals: tuple[int, ...]) -> None:
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


def check_run_folder(out_dir: Path) -> None:
    """--out is a folder (or can be made in one that exists), and what the run writes in it
    (``checkpoints/``, ``final/``) is absent or a folder: refused before the model is built, not
    when the first save or the export meets a file there ([Note: run directory])."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: exists and is not a folder")
    if not out_dir.resolve().parent.is_dir():
        raise ConfigError(
            f"--out {out_dir}: folder {out_dir.resolve().parent} does not exist; create it first"
        )
    for name, holds in ((CHECKPOINTS, "its checkpoints"), (FINAL, "the trained model")):
        entry = out_dir / name
        if entry.is_dir():  # a folder, or a link to one: the run writes into it
            continue
        if os.path.lexists(entry):
            try:
                kind = kind_of(os.stat(entry).st_mode)
            except OSError:
                kind = "a symlink to nothing"
            raise ConfigError(
                f"--out {out_dir}: {entry} is {kind}, where the run writes {holds} (a folder): move it "
                "away, or pass another --out"
            )


@dataclass
class CheckpointPolicy:
    """Where a run's checkpoints and export go and when it saves ([Note: run directory])."""

    out_dir: Path
    save_every: int | None = None
    keep_last: int | None = None
    resume: str | None = None
    """None: start fresh; "latest": the newest valid checkpoint under out_dir; else a path."""
    save_on_interrupt: bool = True
    model_folder: Path | None = None
    """The model folder whose tokenizer files go into the export."""
    lora: bool = False
    merge_lora: bool = False
    model_class: str = "AutoModelForCausalLM"
    """The transformers class the load line names (a wrapped model's own where the auto class has none)."""
    stop: StopRequest = field(default_factory=StopRequest)
    saved: list[str] = field(default_factory=list)
    resumed_from: str | None = None
    final_path: str | None = None
    rank: int = 0
    """This process's rank (set by `start`): only rank 0 writes what is not collective."""

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if self.save_every is not None and self.save_every < 1:
            raise ConfigError(f"--save-every must be >= 1, got {self.save_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"--keep-last must be >= 1 (the newest is always kept), got {self.keep_last}")
        if self.merge_lora and not self.lora:
            raise ConfigError("--merge-lora needs --lora (there is no adapter to merge)")
        check_run_folder(self.out_dir)
        if self.resume is not None and self.resume != "latest" and not Path(self.resume).exists():
            raise ConfigError(
                f"--resume {self.resume}: no such checkpoint; pass a checkpoint folder (holding manifest.json), "
                "a checkpoints folder, or --resume alone for the newest valid one under --out"
            )

    @property
    def checkpoints_dir(self) -> Path:
        return self.out_dir / CHECKPOINTS

    @property
    def final_dir(self) -> Path:
        return self.out_dir / FINAL

    # ---- resume ------------------------------------------------------------------------------
    def resume_target(self) -> tuple[str, str | None] | None:
        """(load_dir, tag) of the checkpoint to resume from, or None for a fresh start."""
        from tiered.checkpoint.directory import MANIFEST, find_latest_valid

        if self.resume is None:
            return None
        if self.resume == "latest":
            tag = find_latest_valid(str(self.checkpoints_dir))
            if tag is None:
                raise ConfigError(
                    f"--resume: no complete checkpoint under {self.checkpoints_dir}; drop --resume to start "
                    "fresh, or pass --resume PATH"
                )
            return str(self.checkpoints_dir), tag
        p = Path(self.resume)
        if (p / MANIFEST).is_file() or not (p / "latest").is_file():
            # a checkpoint folder (or a half-written one: load_checkpoint names what is wrong)
            return str(p.resolve().parent), p.resolve().name
        return str(p), None

    def start(self, engine: Any, stream: Any) -> int:
        """Load the checkpoint to resume from, if any, into `engine` and `stream`; returns the
        optimizer steps already done."""
        self.rank = int(engine.rank)
        self.checkpoints_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # [Note: private checkpoints]
        target = self.resume_target()
        if target is None:
            return 0
        path, client = engine.load_checkpoint(target[0], tag=target[1])
        data = (client or {}).get(DATA_STATE)
        if data is None:
            raise ConfigError(
                f"--resume {path}: the checkpoint has no data position (client_state[{DATA_STATE!r}]); "
                "it was not written by tiered finetune"
            )
        stream.load_state_dict(data)
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, engine.global_steps)
        return int(engine.global_steps)

    # ---- saving ------------------------------------------------------------------------------
    def after_step(self, engine: Any, stream: Any, step: int, last: bool) -> bool:
        """Save when due (every --save-every steps, or on a stop request); True: stop now."""
        sig = self.stop.signum or 0
        if self.save_on_interrupt and engine.world_size > 1:
            sig = _max_over_ranks(sig, engine.process_group)  # [Note: stop on a signal]
        stopping = sig != 0 and not last
        if stopping:
            self.stop.decided = sig
        if (self.save_every is not None and step % self.save_every == 0) or (
            stopping and self.save_on_interrupt
        ):
            self.save(engine, stream)
        return stopping

    def save(self, engine: Any, stream: Any) -> str:
        path = engine.save_checkpoint(
            str(self.checkpoints_dir), client_state={DATA_STATE: stream.state_dict()}
        )
        self.saved.append(path)
        log.info("checkpoint %s", path)
        if self.keep_last is not None and self.rank == 0:
            self.prune(self.keep_last)
        return str(path)

    def prune(self, keep: int) -> list[str]:
        """Delete the oldest complete checkpoints beyond `keep` ([Note: pruning checkpoints]).
        Returns the deleted paths."""
        from tiered.checkpoint.directory import MANIFEST, read_latest, read_manifest
        from tiered.checkpoint.paths import owned_dir
        from tiered.checkpoint.writer import check_published

        root = str(self.checkpoints_dir)
        latest = read_latest(root)
        found: list[tuple[int, float, str]] = []
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.startswith(".") or name == "latest":
                continue
            if not owned_dir(path):  # a symlink, a file, someone else's folder: not ours to judge
                log.info("pruning: skipping %s (not a checkpoint folder this run wrote)", path)
                continue
            try:
                m = read_manifest(path)
            except (OSError, ValueError):
                continue  # incomplete or not a checkpoint: not ours to judge
            if m.get("tag") != name:  # written under another name (copied or renamed by hand)
                log.info("pruning: skipping %s (its manifest names tag %r)", path, m.get("tag"))
                continue
            steps = int((m.get("training") or {}).get("global_steps", -1))
            found.append((steps, os.path.getmtime(os.path.join(path, MANIFEST)), name))
        found.sort(reverse=True)
        kept = [n for _, _, n in found[:keep]]
        if latest not in kept:
            log.warning(
                "pruning: %s/latest names %r, not one of the %d newest checkpoints (%s): nothing deleted",
                root,
                latest,
                keep,
                ", ".join(kept),
            )
            return []
        for name in kept:  # every checkpoint kept in place of the deleted ones reads back whole
            path = os.path.join(root, name)
            try:
                check_published(path, read_manifest(path))
            except (OSError, ValueError) as e:
                log.warning("pruning: kept checkpoint %s does not verify (%s): nothing deleted", path, e)
                return []
        deleted = []
        for _, _, name in found[keep:]:
            if name == latest:
                continue
            shutil.rmtree(os.path.join(root, name))
            deleted.append(os.path.join(root, name))
        return deleted

    # ---- the export --------------------------------------------------------------------------
    def export(self, engine: Any, model: torch.nn.Module) -> str:
        """DIR/final ([Note: run directory]) while the engine is open."""
        final = str(self.final_dir)
        if self.lora:
            from tiered.finetune.lora import save_adapter

            save_adapter(engine, model, final, base_model=self.model_folder)
            if self.rank == 0:
                self.copy_tokenizer(final)
        else:
            dt = engine.placement.compute_dtype
            # the model folder's tokenizer files too ([Note: tokenizer files in the export]), even
            # when the weights were not streamed from it (a config-only folder)
            engine.save_pretrained(final, dtype=dt, max_shard_size="5GB", tokenizer=self.model_folder)
        self.final_path = final
        return final

    def export_merged(self, model: torch.nn.Module) -> str:
        """DIR/final/merged: the LoRA adapters merged into the base (after the engine closed and
        gave the module its trained weights back)."""
        merged = str(self.final_dir / MERGED)
        base = model.merge_and_unload()  # type: ignore[operator]
        if self.rank == 0:  # every rank holds the same merged weights: one writes them
            base.save_pretrained(merged)
            self.copy_tokenizer(merged)
        return merged

    def copy_tokenizer(self, dest: str) -> list[str]:
        """The model folder's tokenizer files into `dest` (the names copied)."""
        return write_tokenizer(dest, self.model_folder)

    def load_line(self) -> str:
        """The one line that loads the export."""
        # absolute: the line is run from wherever the user is, not from where the run started
        final = str(self.final_dir.resolve())
        if self.lora:
            base = str(Path(self.model_folder).resolve()) if self.model_folder is not None else "BASE_MODEL"
            return f'PeftModel.from_pretrained({self.model_class}.from_pretrained("{base}"), "{final}")'
        return f'{self.model_class}.from_pretrained("{final}")'


def _max_over_ranks(x: int, process_group: Any) -> int:
    """The largest `x` of the ranks of `process_group` (NCCL reduces device tensors only)."""
    import torch.distributed as dist

    on = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(process_group) == "nccl"
        else None
    )
    t = torch.tensor([x], dtype=torch.int32, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
    return int(t.item())
