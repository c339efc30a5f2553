"""Optimizer-state formats (``tiered.optimizer_state_format``): how Adam's moments are stored.

[Note: compressed optimizer state]
Exact fp32 Adam moves 12 bytes of state per parameter each way per step (fp32 master, exp_avg,
exp_avg_sq); with the state on NVMe that is most of a step's I/O. A compressed format stores the
two moments in fewer bytes and keeps the fp32 master exact (rounding the master would lose the
small updates of late training). The update itself is exact fp32 Adam on the decoded moments
(`adam_step_compressed`: decode, `tiered_ext.adam_step`, encode); only the stored moments are
rounded, stochastically, so each is unbiased (tiered/optim/state_codecs.py says why: nearest
rounding would freeze them). Opt-in, never the default; Adam and AdamW only (the moments are
Adam's). The formats, their bytes and their error (the codecs' `error_bound`, tested):

| format | exp_avg | exp_avg_sq | state bytes / param | round-trip error per element |
|---|---|---|---|---|
| ``fp32`` (default) | fp32 | fp32 | 12 | none |
| ``bf16`` | bf16, stochastic rounding | bf16, stochastic rounding | 8 | < 2^-7 of the value (one bf16 step) |
| ``int8`` | 8-bit signed log code, 8 steps per octave, per 256-block absmax | sqrt(v) as an 8-bit log code, 16 steps per octave, per 256-block max | 6.03 | exp_avg: < 9.06% of the value (2^(1/8) - 1) down to 2^-15.75 = 1.81e-5 x its block's max, below that < that level; sqrt(exp_avg_sq): < 4.43% of it (2^(1/16) - 1) down to 2^-15.875 = 1.66e-5 x its block's max, below that < that level |

bf16 keeps fp32's exponent range, so nothing under- or overflows; stochastic rounding keeps the
sign, so exp_avg_sq stays >= 0. int8 follows bitsandbytes' block-wise 8-bit Adam in storing one
scale per 256 elements, but its codes are logarithmic (a constant relative step from the block's
maximum down to 2^-15.75 of it) rather than bitsandbytes' dynamic tree, so the error is stated per
element as a fraction of the value; exp_avg_sq is stored as its square root (the quantity the
update divides by), which halves its dynamic range, keeps it non-negative and zero exact, and
keeps small values accurate, where a linear code would round a small denominator to 0 and turn
its element's update into m / eps. sqrt(v) is unbiased; v itself is biased up by the variance of
its rounding (under 0.05% of v), the safe direction (a slightly smaller step).

In the offloaded optimizer (tiered/optim/offload.py, `OffloadedAdam._update`) each tile's
moments live in their partitions as the format stores them (bf16: a bfloat16 partition of the
tile's elements; int8: a byte partition, the tile's block scales then its codes); the step
fetches them, decodes into one pair of fp32 tensors (allocated with the optimizer at the largest
tile's size, `decode_scratch_numel`, and counted by the memory model), runs the same
tiered_ext Adam kernel on the fp32 master, and encodes back before the write-back, so NVMe
moves the encoded bytes ([Note: bytes per step] counts them at the same size). The rounding's
noise is a hash of (step, moment, group) and each element's index in its group's global flat
buffer (`rounding_noise`, [Note: counter-based rounding noise] in rounding_noise.py): a resumed run
rounds exactly as the uninterrupted one, and on any thread count, tile size or world size.
Checkpoints never held rounding state (the first versions seeded a torch generator from (step,
group, tile) per tile and step), so every checkpoint loads as before and decodes to the same
fp32; a run resumed from one written before the noise changed continues from exactly those
moments and only rounds its later steps with the new noise, as any run now does. Elements a step skips ([Note: parameters without a gradient
are not stepped]) are re-encoded with their block: exact in bf16 (a bf16 value re-rounds to
itself), within the bound and unbiased in int8. Only CPU-stepped, offloaded state is compressed:
a group whose state stays in "gpu" (offload_optimizer.device none, ratio < 1) is refused by name.

The codecs' own time is kept small by [Note: codec speed] (tiered/optim/state_codecs.py).
What this costs in training is measured, not assumed: `tests/test_state_format.py` bounds one
step's parameter change against exact Adam from the codec bounds, and trains a small model both
ways; tests/test_state_format_engine.py trains through the engine with each format.

Checkpoints record the format (``optimizer_state_format`` in the manifest, and the resolved
config). `check_checkpoint_format` states the rule for loading them: a run loads moments of its
own format as they are (bf16 ones reshard like fp32 ones, addressed by element; int8 ones are
block codes whose scales belong to a tile, so they load only into the same ranks, groups and
tiles, `tile_bytes` in the manifest, refused by name otherwise), and an fp32 run loads bf16 or
int8 moments decoded, which is exact (every decoded value is an fp32 value: the fp32 run
continues from exactly the moments the compressed run would have stepped on). The decode streams
(tiered/checkpoint/decode_load.py): chunk by chunk of each fp32 tile, from the same per-element
copies an fp32 checkpoint loads with, so any world size, groups and tiles; for int8 each chunk
reads just the whole blocks it needs (their scales and codes) within the saved tile
`tile_bytes` locates, and decodes them with this module's codec. Anything else (fp32 into bf16
or int8, bf16 into int8, int8 into bf16) would round the saved moments and is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from typing_extensions import Unpack

import tiered_ext
from tiered.config.schema import OPTIMIZER_STATE_FORMATS
from tiered.errors import CheckpointMismatchError, ConfigError, UnsupportedConfigError
from tiered.optim.rounding_noise import RoundingNoise, noise_key
from tiered.optim.state_codecs import (
    Bf16StochasticCodec,
    BlockLogCodec,
    Fp32Codec,
    MomentCodec,
)

if TYPE_CHECKING:  # (tiered_ext imports tiered while it initialises: the type only)
    from tiered_ext import AdamScalars

ADAM_OPTIMIZERS = ("Adam", "AdamW")


@dataclass(frozen=True)
class StateFormat:
    """How one format stores exp_avg and exp_avg_sq (the fp32 master is always kept as it is)."""

    name: str
    exp_avg: MomentCodec
    exp_avg_sq: MomentCodec

    @property
    def lossless(self) -> bool:
        return self.exp_avg.lossless and self.exp_avg_sq.lossless

    def moment_bytes(self, numel: int) -> int:
        """Bytes of both moments of `numel` parameters."""
        return self.exp_avg.encoded_bytes(numel) + self.exp_avg_sq.encoded_bytes(numel)

    def state_bytes(self, numel: int) -> int:
        """Bytes of the whole Adam state (fp32 master and both moments) of `numel` parameters."""
        return 4 * numel + self.moment_bytes(numel)


_FP32 = Fp32Codec()
FORMATS: dict[str, StateFormat] = {
    "fp32": StateFormat("fp32", _FP32, _FP32),
    "bf16": StateFormat("bf16", Bf16StochasticCodec(), Bf16StochasticCodec()),
    "int8": StateFormat(
        "int8",
        BlockLogCodec("int8 exp_avg", signed=True, steps_per_octave=8),
        BlockLogCodec("int8 exp_avg_sq", signed=False, steps_per_octave=16, sqrt_domain=True),
    ),
}
assert tuple(FORMATS) == OPTIMIZER_STATE_FORMATS, "the config's names and the codecs' must agree"


def state_format(
    name: str, *, optimizer: str = "AdamW", key: str = "tiered.optimizer_state_format"
) -> StateFormat:
    """The format `name`, for a run of `optimizer`; ConfigError naming `key` and the formats that
    exist for an unknown name, UnsupportedConfigError for a compressed format with a non-Adam one."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ConfigError(
            f"{key} = {name!r} is not an optimizer-state format; use one of "
            f"{', '.join(repr(n) for n in FORMATS)} (default 'fp32', exact)"
        )
    if not fmt.lossless and optimizer not in ADAM_OPTIMIZERS:
        raise UnsupportedConfigError(
            f"{key} = {name!r} compresses Adam's exp_avg and exp_avg_sq, but the optimizer is "
            f"{optimizer!r}; use Adam or AdamW, or {key} 'fp32'"
        )
    return fmt


MOMENTS = ("exp_avg", "exp_avg_sq")


def rounding_noise(step: int, group: int, moment: str, offset: int) -> RoundingNoise:
    """The rounding noise of moment `moment` ("exp_avg" / "exp_avg_sq") of group `group` at
    optimizer step `step`, for an encode whose first element is element `offset` of the group's
    global flat buffer (a rank's shard offset plus the tile's start): a function of what a
    checkpoint holds and where the element is, not of the tile, rank or thread that encodes it
    ([Note: counter-based rounding noise])."""
    return RoundingNoise(noise_key(step, MOMENTS.index(moment), group), offset)


def check_checkpoint_format(saved: str, running: str, *, path: str) -> Literal["same", "decode"]:
    """How a checkpoint whose moments are in format `saved` loads into a run of format `running`:
    as they are, decoded exactly into fp32, or (lossy) a CheckpointMismatchError naming both."""
    for name, what in ((saved, "the checkpoint's"), (running, "this run's")):
        if name not in FORMATS:
            raise CheckpointMismatchError(
                f"checkpoint {path}: {what} optimizer-state format {name!r} is unknown "
                f"(known: {', '.join(FORMATS)})"
            )
    if saved == running:
        return "same"
    if running == "fp32":
        return "decode"  # every decoded value is an fp32 value: the fp32 run continues from it exactly
    raise CheckpointMismatchError(
        f"checkpoint {path} holds the optimizer state in format {saved!r}, this run stores it as "
        f"{running!r}; converting would round the saved moments. Load it with "
        f"tiered.optimizer_state_format {saved!r} (or 'fp32', which decodes it exactly)"
    )


def check_state_format_loads(
    manifest: dict[str, Any], running: str, path: str
) -> dict[str, MomentCodec] | None:
    """How a checkpoint's moments (format `manifest` records; older ones hold fp32) load into a
    run of format `running`: None, as they are (the same format); the saved format's codec of each
    moment, to decode them exactly into this fp32 run; or a CheckpointMismatchError by name
    (`check_checkpoint_format`: a conversion that would round them)."""
    saved = manifest.get("optimizer_state_format", "fp32")
    if check_checkpoint_format(saved, running, path=path) == "same":
        return None
    fmt = FORMATS[saved]
    return {"exp_avg": fmt.exp_avg, "exp_avg_sq": fmt.exp_avg_sq}


def adam_step_compressed(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    fmt: StateFormat,
    *,
    step: int,
    group: int = 0,
    offset: int = 0,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    **hyper: Unpack[AdamScalars],
) -> None:
    """One exact fp32 Adam/AdamW step of flat fp32 `param` whose moments are stored encoded in
    `fmt` (uint8 `exp_avg` / `exp_avg_sq` buffers, updated in place); `hyper` as
    `tiered_ext.adam_step`'s. `group` and `offset` place the elements for the rounding noise
    (`rounding_noise`). `scratch`: two fp32 tensors of param's size for the decoded moments
    (allocated when not given)."""
    n = param.numel()
    m, v = scratch if scratch is not None else (torch.empty(n), torch.empty(n))
    fmt.exp_avg.decode(exp_avg, m)
    fmt.exp_avg_sq.decode(exp_avg_sq, v)
    tiered_ext.adam_step(param, grad, m, v, step=step, **hyper)
    fmt.exp_avg.encode(m, exp_avg, rounding_noise(step, group, "exp_avg", offset))
    fmt.exp_avg_sq.encode(v, exp_avg_sq, rounding_noise(step, group, "exp_avg_sq", offset))
