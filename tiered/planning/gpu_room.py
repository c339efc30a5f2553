"""The GPU's room beyond the working set, given to what saves the most: persistent parameters or
a share of the Adam state stepped there.

[Note: the GPU's room searched]
The grid ([Note: config search]) sizes each candidate's GPU need; what the GPU has beyond it
would sit idle while bytes move below it. Two uses of that room are weighed, each as a real
config the engine's memory model predicts:

* **persistent parameter groups** ([Note: persistent by room] in tiered/zero/layout.py): the gpu
  budget holds them, saving their host->device copies (``tiered.residency: "auto"``);
* **a share of the optimizer state stepped on the GPU**: ``offload_optimizer.ratio`` below 1
  ([Note: twin-flow ratio] in tiered/optim/placement.py) keeps the state of the smallest groups
  in the gpu tier and steps them with the GPU Adam, saving their state's NVMe reads and writes
  (or, with the state in host memory, the CPU Adam's time). The ratio is sized from the bytes
  per element a GPU-stepped group costs there (measured on the config itself, at one trial
  ratio) and lowered until the config fits.

The faster is kept (ties: fewer bytes moved). Where the activations' memory is not known
(``--activation-mem``, ``--seq-len``), half of the room is used and the gpu budget written is the
working set plus that half: the tier never holds more, and the other half is the activations'
(`ASSUMED_ACTIVATION_SHARE`, said in the plan's assumptions); where it is known, all of it. A
ratio the user's config sets is DeepSpeed's and the only one weighed; none is searched on a
machine without a GPU (its "gpu" tier is host memory: no faster kernel or link to win).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

WeighAt = Callable[[Any, dict[str, Any], "int | None"], Any]
"""search.py's `_weigh_at(setup, knobs, live) -> Candidate` (passed in: search.py imports this module)."""

ASSUMED_ACTIVATION_SHARE = 0.5
"""Of the GPU's room beyond the working set, the share left to activations of unknown size."""
_TRIAL_RATIO = 0.5
"""The share weighed once to learn the bytes per element a GPU-stepped group costs there."""
_FITTING_TRIES = 8


def fill_gpu_room(s: Any, c: Any, ratio_pinned: bool, weigh_at: WeighAt) -> Any:
    """`c` (a fitting `Candidate` of the `Setup` `s`), or a config that uses the GPU's room beyond
    its need better ([Note: the GPU's room searched]); `c` where there is no room or nothing to win."""
    if s.device_kind == "cpu" or s.mem.gpu is None or c.prediction is None or not c.fits:
        return c
    given = s.mem.gpu - (s.mem.activations or 0)
    room = given - c.peaks["device"]
    if s.mem.activations is None:
        room = int(room * (1 - ASSUMED_ACTIVATION_SHARE))
    if room <= 0:
        return c
    # the gpu budget written: the working set and the room used, no more ([Note: persistent by room])
    at = dataclasses.replace(s, mem=dataclasses.replace(s.mem, gpu=c.peaks["device"] + room, activations=0))
    knobs = {k: v for k, v in c.knobs.items() if k not in ("residency", "ratio")}
    live = c.config["zero_optimization"].get("stage3_max_live_parameters")  # written, or the default
    variants = [c, weigh_at(at, knobs, live)]  # persistent groups by room
    if c.knobs["offload_optimizer"] != "none" and not ratio_pinned:
        shared = _ratio_in_room(at, {**knobs, "residency": "host"}, live, weigh_at)
        if shared is not None:
            variants.append(shared)
    return min(
        (v for v in variants if v.fits),
        key=lambda v: (round(v.seconds_per_step, 6), sum(v.traffic.values()), v.peaks.get("device", 0)),
    )


def _ratio_in_room(s: Any, knobs: dict[str, Any], live: int | None, weigh_at: WeighAt) -> Any:
    """The config with the largest share of its state stepped on the GPU that fits `s`'s gpu
    budget, None where no share does. The placement steps the smallest groups on the GPU
    ([Note: twin-flow ratio]): so k of them are chosen by their sizes, at the bytes per element
    a trial share costs there, and the ratio written is exactly (n - k) / n."""
    assert s.mem.gpu is not None
    whole = weigh_at(s, {**knobs, "ratio": 1.0}, live)
    trial = weigh_at(s, {**knobs, "ratio": _TRIAL_RATIO}, live)
    if whole.prediction is None or trial.prediction is None:
        return None
    sizes = sorted(g.shard_numel for g in whole.prediction.groups if g.trainable)
    n = len(sizes)
    trial_elements = sum(sizes[: n - int(round(_TRIAL_RATIO * n))])
    per_element = (trial.peaks["device"] - whole.peaks["device"]) / max(1, trial_elements)
    if per_element <= 0:
        return None
    room, k, used = s.mem.gpu - whole.peaks["device"], 0, 0.0
    while k < n and used + sizes[k] * per_element <= room:
        used += sizes[k] * per_element
        k += 1
    for _ in range(_FITTING_TRIES):
        if k <= 0:
            return None
        c = weigh_at(s, {**knobs, "ratio": (n - k) / n}, live)
        if c.fits:
            return c
        k = int(k * 0.97)  # what the per-element estimate missed (staging, alignment): a little less
    return None
