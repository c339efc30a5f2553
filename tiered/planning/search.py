"""Fit, then fastest: the configs `tiered plan` and ``"auto_config"`` weigh, each checked by
the engine's own memory model, ranked by the predicted seconds per step.

[Note: config search]
The knobs searched are the ones that change what a run needs or moves: where the optimizer
state, the parameters and the gradients live (``offload_optimizer.device``,
``offload_param.device``, ``tiered.grad_tier``), ``sub_group_size`` (group splits and the
optimizer pipeline's tile), ``offload_optimizer.buffer_count`` (pipeline depth) and
``stage3_param_persistence_threshold`` (small parameters kept on the GPU). ``offload_param.max_in_cpu``
is not a grid: it is set to the parameter elements the cpu budget has room for once the run's
need is met (their dirty copies save the NVMe reads of [Note: max_in_cpu]); the parameter buffers
of DeepSpeed (``offload_param.buffer_count/buffer_size``) are not searched because the engine
stages parameters in the cpu tier, whose budget already bounds them. Each candidate is a
DeepSpeed-format config with a "tiered" section, resolved by the config loader and predicted by
`tiered.planning.needs.predict` (the engine's pre-flight arithmetic): it fits when every tier's
need is within its budget and the host's total ([Note: one memory model]) within ``cpu_mem``.
Budgets are what the user gave: the gpu tier gets ``gpu_mem`` less the declared activations, the
cpu tier ``cpu_mem`` less the process baseline (of the device kind the run will have: "cuda"
unless told), what the engine holds outside the tiers and the backends' own buffers, never more. Fitting configs are ranked by predicted s/step: [Note: bytes per step] per link
divided by the link's bandwidth, the links overlapped (the slowest one bounds the step; one
drive's reads and writes share it) and the CPU Adam at its element rate; GPU compute is not
modelled (it is the same for every candidate). A knob the user pins is never varied; pinned
knobs that contradict each other (a grad tier on NVMe with the optimizer on the GPU, say) are
refused by name.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiered.errors import CapacityError, ConfigError
from tiered.optim.arrivals import grads_consumed_from_memory
from tiered.planning.needs import Prediction, predict
from tiered.planning.traffic import bytes_per_step
from tiered.units import format_bytes

if TYPE_CHECKING:
    from tiered.zero.layout import GroupLayout

SUB_GROUP_SIZES = (1_000_000_000, 200_000_000, 100_000_000, 50_000_000, 20_000_000, 10_000_000, 5_000_000)
BUFFER_COUNTS = (4, 2, 1)
PERSISTENCE_THRESHOLDS = (100_000, 0)
PLACEMENTS = (  # (optimizer device, parameter device, grad tier): cheapest first
    ("none", "none", "gpu"),
    ("cpu", "none", "cpu"),
    ("cpu", "cpu", "cpu"),
    ("nvme", "none", "cpu"),
    ("nvme", "cpu", "cpu"),
    ("nvme", "nvme", "cpu"),
    ("cpu", "nvme", "cpu"),
    ("nvme", "nvme", "nvme"),
    ("cpu", "cpu", "nvme"),
    ("nvme", "cpu", "nvme"),
)
KNOBS = (
    "offload_optimizer",
    "offload_param",
    "grad_tier",
    "sub_group_size",
    "buffer_count",
    "persistence_threshold",
    "max_in_cpu",
)
"""The knobs a user may pin (`Pinned`), by the names the plan's flags and errors use."""

DEFAULT_BANDWIDTH = {"disk_read": 3.0e9, "disk_write": 2.0e9, "h2d": 20e9, "d2h": 20e9, "cpu_adam": 1.0e9}
"""Bytes/s per link and CPU Adam elements/s assumed without ``--bandwidth`` (one PCIe 4.0 NVMe
drive, PCIe 4.0 x16 pinned copies, the AVX2 fused Adam on a few cores): printed as assumptions."""


@dataclass(frozen=True)
class Memories:
    """What the user said each memory has per rank (None: not given, not checked)."""

    gpu: int | None = None
    cpu: int | None = None
    nvme: int | None = None
    activations: int = 0


@dataclass(frozen=True)
class Pinned:
    """Knobs the user fixed; None = searched."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def check(self) -> None:
        """Refuse contradictory pins by name ([Note: config search])."""
        v = self.values
        opt, par, grad = v.get("offload_optimizer"), v.get("offload_param"), v.get("grad_tier")
        problems = []
        if opt == "none" and grad not in (None, "gpu"):
            problems.append(
                f"--grad-tier {grad} needs the optimizer offloaded, but --offload-optimizer is none"
            )
        if opt == "none" and par not in (None, "none"):
            problems.append(
                f"--offload-param {par} needs the optimizer offloaded, but --offload-optimizer is none"
            )
        if opt not in (None, "none") and grad == "gpu":
            problems.append(
                f"--grad-tier gpu needs the optimizer on the GPU, but --offload-optimizer is {opt}"
            )
        if v.get("max_in_cpu") not in (None, 0) and par not in (None, "nvme"):
            problems.append(f"--max-in-cpu keeps NVMe parameters in cpu, but --offload-param is {par}")
        if problems:
            raise ConfigError("contradictory pinned knobs: " + "; ".join(problems))


@dataclass(frozen=True)
class Candidate:
    """One config weighed: its knobs, the config, the prediction and the verdict."""

    knobs: dict[str, Any]
    config: dict[str, Any]
    prediction: Prediction | None
    shortfalls: dict[str, int]
    """memory ("gpu", "host", "nvme") -> bytes short; empty when it fits."""
    refused: str = ""
    """Why the engine would refuse it before any byte is counted (a module that cannot be gathered)."""
    peaks: dict[str, int] = field(default_factory=dict)
    traffic: dict[str, int] = field(default_factory=dict)
    seconds_per_step: float = float("inf")

    @property
    def fits(self) -> bool:
        return not self.shortfalls and not self.refused


def read_bandwidth(path: str | Path) -> tuple[dict[str, float], list[str]]:
    """Link bandwidths from `tiered bench --json FILE` output; what was taken from where."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"--bandwidth {path}: no such file; write one with tiered bench --json FILE"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"--bandwidth {path}: not a JSON file ({exc}); pass the file tiered bench --json wrote"
        ) from None
    methods = doc.get("methods") if isinstance(doc, dict) else None
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise ConfigError(
            f'--bandwidth {path}: not tiered bench\'s JSON (no "methods" list of results); pass the file '
            "tiered bench --json FILE wrote"
        )
    bw = dict(DEFAULT_BANDWIDTH)
    said: list[str] = []
    ok = [m for m in methods if m.get("status") == "ok" and m.get("read_gbps") and m.get("write_gbps")]
    disk = next((m for m in ok if m.get("name") == "nvme"), None) or max(
        ok, key=lambda m: m["read_gbps"], default=None
    )
    if disk is not None:
        bw["disk_read"], bw["disk_write"] = float(disk["read_gbps"]) * 1e9, float(disk["write_gbps"]) * 1e9
        said.append(
            f"disk {disk['read_gbps']:.2f} / {disk['write_gbps']:.2f} GB/s read / write ({disk.get('name')}, {path})"
        )
    else:
        said.append(
            f"disk: no successful method in {path}; assumed {_gbps(bw['disk_read'])} / {_gbps(bw['disk_write'])}"
        )
    link = doc.get("gpu_link")
    if isinstance(link, dict) and link.get("available"):
        bw["h2d"] = float(link["h2d_gbps"]["pinned"]) * 1e9
        bw["d2h"] = float(link["d2h_gbps"]["pinned"]) * 1e9
        said.append(f"host<->device {_gbps(bw['h2d'])} / {_gbps(bw['d2h'])} (pinned, {path})")
    else:
        said.append(f"host<->device: not in {path}; assumed {_gbps(bw['h2d'])}")
    return bw, said


def _gbps(b: float) -> str:
    return f"{b / 1e9:.1f} GB/s"


def seconds_per_step(traffic: Mapping[str, int], adam_elements: int, bw: Mapping[str, float]) -> float:
    """[Note: config search]: the slowest of the overlapped links bounds the step."""
    disk = traffic["disk->host"] / bw["disk_read"] + traffic["host->disk"] / bw["disk_write"]
    return max(
        disk,
        traffic["host->device"] / bw["h2d"],
        traffic["device->host"] / bw["d2h"],
        adam_elements / bw["cpu_adam"],
    )


def candidate_config(
    knobs: Mapping[str, Any],
    *,
    precision: str,
    accumulation: int,
    nvme_path: str,
    budgets: Mapping[str, int | None],
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed-format config (+ "tiered") for one set of knobs; with `base` (a user's
    config, [Note: auto config]) its other keys are kept and the knobs' keys set."""
    if base is not None:
        own = candidate_config(
            knobs, precision=precision, accumulation=accumulation, nvme_path=nvme_path, budgets=budgets
        )
        return _onto(base, own)
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": knobs["sub_group_size"],
        "stage3_param_persistence_threshold": knobs["persistence_threshold"],
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if knobs.get("max_live_parameters"):
        zero["stage3_max_live_parameters"] = knobs["max_live_parameters"]
    if knobs["offload_optimizer"] != "none":
        off: dict[str, Any] = {
            "device": knobs["offload_optimizer"],
            "pin_memory": True,
            "buffer_count": knobs["buffer_count"],
        }
        if knobs["offload_optimizer"] == "nvme":
            off["nvme_path"] = nvme_path
        zero["offload_optimizer"] = off
    if knobs["offload_param"] != "none":
        offp: dict[str, Any] = {"device": knobs["offload_param"], "pin_memory": True}
        if knobs["offload_param"] == "nvme":
            offp.update(nvme_path=nvme_path, max_in_cpu=knobs["max_in_cpu"])
        zero["offload_param"] = offp
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
    }
    if precision in ("bf16", "fp16"):
        config[precision] = {"enabled": True}
    config["zero_optimization"] = zero
    tiers = {t: {"budget": b} for t, b in budgets.items() if b is not None}
    if "nvme" in tiers and "nvme" not in (
        knobs["offload_optimizer"],
        knobs["offload_param"],
        knobs["grad_tier"],
    ):
        del tiers["nvme"]
    tiered: dict[str, Any] = {"tiers": tiers}
    if knobs["grad_tier"] not in ("cpu", "gpu"):
        tiered["grad_tier"] = knobs["grad_tier"]  # [Note: gradients on nvme]
    config["tiered"] = tiered
    return config


def _onto(base: Mapping[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """`base` with the chosen zero_optimization and tiered keys set (the rest of base kept)."""
    out = copy.deepcopy(dict(base))
    zero = out.setdefault("zero_optimization", {})
    zero["stage"] = 3
    for key, value in chosen["zero_optimization"].items():
        if isinstance(value, dict):
            zero[key] = {**(zero.get(key) or {}), **value}
        elif key not in zero or key in ("sub_group_size", "stage3_param_persistence_threshold"):
            zero[key] = value
    for key in ("offload_optimizer", "offload_param"):
        if key not in chosen["zero_optimization"] and key in zero:
            del zero[key]  # the chosen placement keeps it on the GPU
    tiered = out.setdefault("tiered", {})
    tiered["tiers"] = chosen["tiered"]["tiers"]
    tiered.pop("grad_tier", None)
    if "grad_tier" in chosen["tiered"]:
        tiered["grad_tier"] = chosen["tiered"]["grad_tier"]
    for key in ("bf16", "fp16", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if key in chosen and key not in out:
            out[key] = chosen[key]
    return out


def knob_grid(pinned: Pinned) -> Iterable[dict[str, Any]]:
    """Every combination of the searched knobs with the pinned ones fixed."""
    pinned.check()
    for (opt, par, grad), sgs, bc, thr in itertools.product(
        PLACEMENTS, SUB_GROUP_SIZES, BUFFER_COUNTS, PERSISTENCE_THRESHOLDS
    ):
        knobs = {
            "offload_optimizer": opt,
            "offload_param": par,
            "grad_tier": grad,
            "sub_group_size": sgs,
            "buffer_count": bc,
            "persistence_threshold": thr,
            "max_in_cpu": 0,
        }
        if any(pinned.get(k) is not None and pinned.get(k) != knobs[k] for k in KNOBS if k != "max_in_cpu"):
            continue
        if opt == "none" and bc != BUFFER_COUNTS[0]:
            continue  # no pipeline: buffer_count changes nothing
        yield knobs
    extra = {k: pinned.get(k) for k in ("sub_group_size", "buffer_count", "persistence_threshold")}
    if any(
        v is not None and v not in grid
        for v, grid in zip(
            extra.values(), (SUB_GROUP_SIZES, BUFFER_COUNTS, PERSISTENCE_THRESHOLDS), strict=True
        )
    ):
        for opt, par, grad in PLACEMENTS:  # a pinned value off the grid: weigh it exactly
            knobs = {
                "offload_optimizer": opt,
                "offload_param": par,
                "grad_tier": grad,
                "sub_group_size": extra["sub_group_size"] or SUB_GROUP_SIZES[2],
                "buffer_count": extra["buffer_count"] or BUFFER_COUNTS[0],
                "persistence_threshold": PERSISTENCE_THRESHOLDS[0]
                if extra["persistence_threshold"] is None
                else extra["persistence_threshold"],
                "max_in_cpu": 0,
            }
            if all(pinned.get(k) is None or pinned.get(k) == knobs[k] for k in KNOBS if k != "max_in_cpu"):
                yield knobs


def live_parameters(model: nn.Module) -> int | None:
    """``stage3_max_live_parameters`` when DeepSpeed's 1e9 cannot hold the largest module and the
    one prefetched after it (a 128k vocabulary's embedding at hidden 8192 is 1.05e9): twice the
    largest module's own parameters; None keeps the default."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return 2 * largest if 2 * largest > 1_000_000_000 else None


def weigh(
    model: nn.Module,
    knobs: dict[str, Any],
    mem: Memories,
    *,
    precision: str = "bf16",
    accumulation: int = 1,
    world_size: int = 1,
    nvme_path: str = "./tiered_offload",
    bandwidth: Mapping[str, float] = DEFAULT_BANDWIDTH,
    max_in_cpu: int | None = None,
    layouts: dict[tuple[object, ...], GroupLayout] | None = None,
    base: Mapping[str, Any] | None = None,
    device_kind: str = "cuda",
) -> Candidate:
    """One config: predicted by the engine's memory model, fit-checked, timed ([Note: config search]).
    `device_kind` ("cuda", "cpu") is the machine's that will run it: the process baseline's
    ([Note: one memory model])."""
    from tiered.config.loader import load_config

    gpu_budget = None if mem.gpu is None else max(0, mem.gpu - mem.activations)
    user_live = (
        None if base is None else (base.get("zero_optimization") or {}).get("stage3_max_live_parameters")
    )
    knobs = {**knobs, "max_live_parameters": None if user_live is not None else live_parameters(model)}
    budgets: dict[str, int | None] = {"gpu": gpu_budget, "cpu": mem.cpu, "nvme": mem.nvme}
    config = candidate_config(
        knobs, precision=precision, accumulation=accumulation, nvme_path=nvme_path, budgets=budgets, base=base
    )
    try:
        cfg = load_config(config, model=model, world_size=world_size)
        pred = predict(model, cfg, world_size=world_size, device_kind=device_kind, layouts=layouts)
    except (CapacityError, ConfigError) as exc:
        return Candidate(knobs, config, None, {}, refused=str(exc))
    cpu_budget = None if mem.cpu is None else max(0, mem.cpu - pred.host_extra_bytes)
    peaks = {m: pred.peak_bytes(m) for m in ("device", "host", "disk")}
    short: dict[str, int] = {}
    for memory, have in (("device", gpu_budget), ("host", mem.cpu), ("disk", mem.nvme)):
        if have is not None and peaks[memory] > have:
            short[memory] = peaks[memory] - have
    knobs = dict(knobs)
    if knobs["offload_param"] == "nvme":  # [Note: config search]: max_in_cpu from the room left
        room = None if cpu_budget is None else max(0, cpu_budget - pred.tier_bytes("host"))
        itemsize = torch.empty(0, dtype=pred.placement.compute_dtype).element_size()
        chosen = (
            max_in_cpu if max_in_cpu is not None else (1_000_000_000 if room is None else room // itemsize)
        )
        knobs["max_in_cpu"] = int(chosen)
        if cpu_budget is not None:  # the kept copies live in the cpu tier, within its budget
            peaks["host"] += min(knobs["max_in_cpu"] * itemsize, max(0, cpu_budget - pred.tier_bytes("host")))
    budgets["cpu"] = cpu_budget
    config = candidate_config(
        knobs, precision=precision, accumulation=accumulation, nvme_path=nvme_path, budgets=budgets, base=base
    )
    traffic = bytes_per_step(
        [g for g in pred.groups],
        list(pred.plans),
        pred.memory,
        compute_dtype=pred.placement.compute_dtype,
        accumulation=accumulation,
        max_in_cpu_numel=knobs["max_in_cpu"],
        state_format=cfg.tiered.optimizer_state_format,
        grads_from_memory=grads_consumed_from_memory(cfg),
        max_live_numel=cfg.zero.max_live_parameters_numel,
        max_reuse_numel=cfg.zero.max_reuse_distance_numel,
    )
    adam = sum(
        g.shard_numel
        for g, p in zip([g for g in pred.groups if g.trainable], pred.plans, strict=True)
        if p.side == "cpu"
    )
    return Candidate(
        knobs,
        config,
        pred,
        short,
        peaks=peaks,
        traffic=traffic,
        seconds_per_step=seconds_per_step(traffic, adam, bandwidth),
    )


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None
    weighed: tuple[Candidate, ...]

    @property
    def closest(self) -> Candidate | None:
        """The config nearest to fitting (least bytes short in all), for the refusal."""
        counted = [c for c in self.weighed if c.prediction is not None]
        return min(counted, key=lambda c: sum(c.shortfalls.values()), default=None)


def search(model: nn.Module, mem: Memories, pinned: Pinned = Pinned(), **kw: Any) -> SearchResult:
    """Every candidate of `knob_grid`, weighed; the fastest that fits (ties: less host memory)."""
    weighed = []
    kw.setdefault("layouts", {})
    for knobs in knob_grid(pinned):
        if pinned.get("max_in_cpu") is not None:
            kw["max_in_cpu"] = pinned.get("max_in_cpu")
        weighed.append(weigh(model, knobs, mem, **kw))
    fits = [c for c in weighed if c.fits]
    best = min(
        fits, key=lambda c: (round(c.seconds_per_step, 6), c.peaks["host"], c.peaks["device"]), default=None
    )
    return SearchResult(best, tuple(weighed))


def shortfall_text(c: Candidate) -> str:
    """Every tier a config is short on, each with the keys that fix it ([Note: config search])."""
    fix = {
        "device": "lower zero_optimization.sub_group_size or stage3_param_persistence_threshold, or offload "
        "parameters (zero_optimization.offload_param.device)",
        "host": 'move state to NVMe (zero_optimization.offload_optimizer.device / offload_param.device "nvme", '
        'tiered.grad_tier "nvme"), lower zero_optimization.sub_group_size or offload_optimizer.buffer_count',
        "disk": "point nvme_path at a larger disk",
    }
    label = {"device": "GPU", "host": "host memory", "disk": "NVMe"}
    return "; ".join(
        f"{label[m]} short by {format_bytes(b, binary=True)}: {fix[m]}" for m, b in c.shortfalls.items()
    )
