"""Every error tiered raises, in one place.

Each subclasses the builtin a user already catches, under one `TieredError` base, so that
``except MemoryError`` and ``except tiered.TieredError`` both work. Messages name the thing at
fault (partition, parameter, key, file, config key) and say what to do.
"""

from __future__ import annotations


class TieredError(Exception):
    """Base of every error tiered raises on purpose."""


class ConfigError(TieredError, ValueError):
    """A configuration value or key is wrong; the message names the key and the fix."""


class UnsupportedConfigError(ConfigError):
    """A recognised (DeepSpeed) key whose feature tiered does not support."""


class UnsupportedFeatureError(UnsupportedConfigError, ImportError):
    """A DeepSpeed feature tiered deliberately lacks (pipeline, tensor or sequence parallelism,
    DeepSpeed-Inference), raised where a script imports or first uses it; the message names the
    feature and what to use instead. An ImportError too, so a script's ``try: from deepspeed.pipe
    import ... except ImportError`` fallback takes its fallback."""


class BackendNotFoundError(TieredError, KeyError):
    """No storage backend is registered under the requested name."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the message as written
        return str(self.args[0]) if self.args else ""


class BackendExistsError(TieredError, ValueError):
    """`register_backend` was given a name another backend holds, without ``clobber=True``."""


class BackendImportError(TieredError, ImportError):
    """A registered backend failed to import (a missing optional dependency, usually)."""


class StorageKeyError(TieredError, KeyError):
    """A key is missing from a backend, or is not a valid key (``/``, ``..``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StorageIOError(TieredError, OSError):
    """A backend failed while reading or writing; the message names the key and file."""


class StorageCorruptError(StorageIOError):
    """Bytes read back from a tier are not the bytes written (checksum mismatch, truncated file);
    the message names partition, tier, file and both checksums. The data was not used."""


class StoredSizeError(TieredError, ValueError):
    """A read target's size differs from the stored object's (both sizes in the message)."""

    def __init__(self, msg: str, stored_nbytes: int | None = None, out_nbytes: int | None = None) -> None:
        super().__init__(msg)
        self.stored_nbytes = stored_nbytes
        self.out_nbytes = out_nbytes


class CapacityError(TieredError, MemoryError):
    """A request can never fit its tier's budget (backpressure cannot help)."""


class TierTimeoutError(TieredError, TimeoutError):
    """A wait on the tier manager outlived its timeout."""


class PinnedError(TieredError, RuntimeError):
    """An operation needs a copy that a fetch or allocate pinned and has not yet released."""


class ManagerClosedError(TieredError, RuntimeError):
    """The tier manager (its loop) was closed while, or before, an operation ran."""


class AlreadyManagedError(TieredError, RuntimeError):
    """`tiered.initialize` on a module another open engine already manages."""


class ShapeMutationError(TieredError, RuntimeError):
    """A module replaced or reshaped a parameter that tiered manages."""


class UsageError(TieredError, TypeError):
    """A tiered (or ported DeepSpeed) function was given an argument of the wrong kind; the message
    names the argument and the documented form."""


class ModelNotInitializedError(TieredError, RuntimeError):
    """A model built under ``deepspeed.zero.Init`` (parameters on the meta device) was run before
    ``initialize`` gave its parameters values."""


class ParameterNotGatheredError(TieredError, RuntimeError):
    """A partitioned parameter's values were read outside forward without gathering them first."""


class CollectiveOrderError(TieredError, RuntimeError):
    """Ranks reached different ZeRO-3 collectives (a gather or gradient reduction of different
    groups): their graphs diverge; the message names the modules and the leaf module to declare."""


class InputDtypeError(TieredError, RuntimeError):
    """An input of the model's forward is not in the compute dtype (fp32 inputs to an fp16 or bf16
    model, float64 or int64 inputs to an fp32 one); the message names the input, both dtypes, the
    module and the fix."""


class LossScaleError(TieredError, FloatingPointError):
    """fp16 gradients overflowed while the loss scale was already at its minimum."""


class NonFiniteError(TieredError, FloatingPointError):
    """A loss or gradient held NaN or inf at an optimizer step (bf16/fp32) with
    ``tiered.nonfinite_step: "raise"``; the message names the step, what was not finite (the loss,
    or the first group whose gradient was) and the key. See [Note: non-finite steps]."""


class InputError(TieredError, ValueError):
    """An input of the model's forward cannot be trained on: an empty batch, or a tensor on the
    meta device (no data); the message names the input and the fix."""


class KernelBuildWarning(UserWarning):
    """The native extension could not be built; the pure-torch reference runs instead."""


class KernelBuildLockError(TieredError, TimeoutError):
    """Another live process held a native kernel's build lock for the whole wait
    (TIERED_EXT_BUILD_WAIT_S); the message names the holder (pid, host) and the build folder."""


class CheckpointNotFoundError(TieredError, FileNotFoundError):
    """A checkpoint directory, tag or ``latest`` pointer that was asked for does not exist."""


class CheckpointCorruptError(TieredError, ValueError):
    """A checkpoint is half-written, has no valid manifest, or a file fails its checksum."""


class CheckpointMismatchError(ConfigError):
    """A checkpoint belongs to another model or an incompatible config; the message names what differs."""


class CheckpointSpaceError(TieredError, OSError):
    """Not enough free space for a checkpoint (checked before writing, or the disk filled up)."""


class CheckpointPathError(TieredError, OSError):
    """A checkpoint folder or entry is not what tiered writes there (a file where a folder goes, a
    symlink, no write permission); the message names the path and the fix."""


class CheckpointLockError(TieredError, TimeoutError):
    """Another process held a checkpoint folder's save lock for the whole wait; the message names
    the lock file and its holder (pid, host)."""


class RunLockError(CheckpointLockError):
    """Another live process runs in the run folder (``tiered finetune --out``) this one was given;
    the message names the lock file and its holder (pid, host)."""


class DistributedSetupError(ConfigError, RuntimeError):
    """A multi-process launch (torchrun: WORLD_SIZE > 1) without a torch.distributed process group."""


class WeightsError(ConfigError):
    """Pretrained weights that cannot be loaded: a missing or unlisted shard, a bad index, a tensor
    whose shape or values do not fit the model; the message names the file and tensor."""
