"""Optimizers and learning-rate schedules for offloaded training."""

from __future__ import annotations

from tiered.optim.cpu_adam import CPUAdam  # noqa: F401  (public API)
from tiered.optim.hyper import ParamHyper  # noqa: F401  (public API)
from tiered.optim.schedulers import build_scheduler  # noqa: F401  (public API)
