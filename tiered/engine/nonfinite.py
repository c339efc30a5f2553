"""What an optimizer step does when its loss or gradients are not finite (bf16 and fp32).

[Note: non-finite steps]
A NaN or inf in a batch, a loss over an empty selection (0/0) or a diverging lr makes the loss
or the gradients non-finite; applied, one such step turns every parameter NaN for good. fp16
has the loss scaler for it (an overflowing step is skipped and the scale lowered, DeepSpeed's
rule: [Note: loss scaling]); bf16 and fp32 have no scale, and there ``tiered.nonfinite_step``
chooses:

- ``"raise"`` (the default): `NonFiniteError` at the step, naming it, what was not finite (the
  loss of which micro-batch, or the first group whose gradient was) and this key. The step's
  gradients are dropped first, so an engine whose caller catches it goes on from clean state.
- ``"skip"`` (the default where a DeepSpeed config sets ``bf16.check_grad_overflow: true``,
  DeepSpeed's switch for the same skip): the step is skipped as an fp16 overflow is
  (``global_steps`` counts it, the optimizer and the lr schedule do not advance), with a
  WARNING, counted in ``stats()["nonfinite_steps"]`` (and in ``skipped_steps``).
- ``"apply"``: plain PyTorch's behaviour, nothing checked: the exact oracle of the equivalence
  tests, at no cost at all.

The default is to raise because a run that skips every step (an lr that diverged) would
otherwise end with exit status 0 and nothing learnt; ``"skip"`` is there for runs that prefer
to step over the odd bad batch (`tiered finetune` counts them on stderr at the end, and exits
with status 3 when every step was skipped).

Cost. The check reads nothing the step does not read already, and never a gradient in storage:
the loss's finiteness is one device op per backward (read with the next sync, never before
backward starts); for the gradients, where the global norm is computed anyway (gradient
clipping), its per-group squared norms say which group is not finite; otherwise each gradient
flush also takes a sum of the gradients it adds, on their device while they are there (one
read of the 16-bit gradients in GPU memory, no sync), and the end of backward looks at those
sums once. Nothing is written: with finite values training is bitwise that of ``"apply"``.
A sum is non-finite iff some element is, unless finite gradients sum past the fp32 range
(3.4e38), which counts as non-finite too.

With ``tiered.overlap_step_with_backward`` the optimizer starts before backward ends: the loss
is then looked at before the overlapped step begins (a non-finite loss is skipped or raised as
above), but a non-finite gradient behind a finite loss is only seen once groups were already
updated; that always raises, saying so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tiered.errors import ConfigError, NonFiniteError

if TYPE_CHECKING:
    from tiered.config.schema import TieredConfig
    from tiered.zero import ZeroParameters
    from tiered.zero.group import GradSummary

log = logging.getLogger(__name__)

KEY = "tiered.nonfinite_step"


def nonfinite_policy(cfg: TieredConfig) -> str:
    """The resolved policy: "raise", "skip", "apply", or "scaler" (fp16: the loss scaler's)."""
    chosen = cfg.tiered.nonfinite_step
    if cfg.precision.dtype == torch.float16:
        if chosen is not None:
            raise ConfigError(
                f"{KEY} = {chosen!r} with fp16: in fp16 the dynamic loss scaler owns non-finite steps "
                "(skipped, the scale lowered; LossScaleError at fp16.min_loss_scale), as in DeepSpeed; "
                f"remove {KEY} or train in bf16"
            )
        return "scaler"
    if chosen is None and cfg.precision.dtype == torch.bfloat16 and cfg.precision.check_grad_overflow:
        return "skip"  # DeepSpeed's bf16.check_grad_overflow: the step is skipped
    return chosen or "raise"


class NonFiniteGuard:
    """One engine's check of [Note: non-finite steps]: what the current accumulation window saw,
    and how many steps it skipped."""

    def __init__(self, cfg: TieredConfig, zero: ZeroParameters, *, norm_computed: bool) -> None:
        self.policy = nonfinite_policy(cfg)
        self.active = self.policy in ("raise", "skip")
        self.steps_skipped = 0
        self.what: str | None = None
        """This window's first non-finite value (the loss of a micro-batch, a group's gradient)."""
        if self.active and not norm_computed:
            zero.probe_finite_grads()

    @property
    def seen(self) -> bool:
        return self.what is not None

    def loss_flag(self, loss: torch.Tensor) -> torch.Tensor | None:
        """A device bool "the loss is finite", not read yet (None when inactive)."""
        return torch.isfinite(loss.detach()) if self.active else None

    def loss_is_finite_now(self, loss: torch.Tensor, micro: int) -> bool:
        """Before an overlapped step begins: read the loss now (one sync)."""
        if not self.active or bool(torch.isfinite(loss.detach())):
            return True
        self._saw(f"the loss of micro-batch {micro} ({float(loss.detach()):g})")
        return False

    def after_backward(
        self, flag: torch.Tensor | None, loss: torch.Tensor, summary: GradSummary, micro: int
    ) -> None:
        if not self.active:
            return
        if flag is not None and not bool(flag):
            self._saw(f"the loss of micro-batch {micro} ({float(loss.detach()):g})")
        if summary.nonfinite_group is not None:
            self._saw(f"the gradient of group {summary.nonfinite_group!r} (micro-batch {micro})")
        elif summary.found_inf:
            self._saw(f"the gradient norm (micro-batch {micro})")

    def reset(self) -> None:
        """A new accumulation window (the gradients were dropped)."""
        self.what = None

    def _saw(self, what: str) -> None:
        if self.what is None:
            self.what = what

    def refuse_step(self, step: int, *, applied: bool) -> NonFiniteError | None:
        """Any rank saw a non-finite value this window: the error to raise once the window is
        dropped, or None after logging the skipped step. `applied`: an overlapped step already
        updated groups (always an error)."""
        what = self.what or "a value on another rank"
        if applied:
            return NonFiniteError(
                f"optimizer step {step}: {what} is not finite, and with tiered.overlap_step_with_backward "
                "the step had already begun: parameters updated in it may hold NaN/inf. Resume from a "
                "checkpoint; to skip such steps instead, set tiered.overlap_step_with_backward to false "
                f'and {KEY} to "skip"'
            )
        if self.policy == "raise":
            return NonFiniteError(
                f"optimizer step {step}: {what} is not finite (NaN or inf), so the step was not applied. "
                "Look for NaN/inf or empty selections (every label ignored) in that batch, or lower the "
                f'learning rate if the loss diverged; set {KEY} to "skip" to skip such steps with a '
                'WARNING, or to "apply" to apply them as plain PyTorch does'
            )
        self.steps_skipped += 1
        log.warning(
            'optimizer step %d: %s is not finite; step skipped (%s = "skip"; %d skipped so far)',
            step,
            what,
            KEY,
            self.steps_skipped,
        )
        return None
