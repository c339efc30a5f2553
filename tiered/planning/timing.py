"""Predicted seconds per step: link bytes over link bandwidths, the CPU Adam, and the compute.

[Note: step time model]
`tiered plan` ranks the configs that fit by a predicted s/step built from three terms, each
from a number the run can measure:

* I/O: [Note: bytes per step] per link over the link's bandwidth (``tiered bench --json``
  output, or `DEFAULT_BANDWIDTH`); the links run concurrently (the tier manager's workers), so
  the slowest bounds the step, one drive's reads and writes sharing it;
* the CPU Adam: the trainable elements the CPU kernel steps over its element rate;
* compute, when the tokens per step are given (``--tokens-per-step``, or ``--seq-len`` x
  ``--micro-batch`` x accumulation): the training FLOPs, 6 x parameters x tokens (forward 2,
  backward 4 per parameter per token; a frozen parameter's backward still propagates the
  input gradient, 2 of the 4, which the formula keeps as a small overestimate) plus one
  forward more (2 x parameters x tokens) with activation checkpointing, over the compute
  device's FLOP rate: ``--flops``; with ``--model`` and ``--seq-len``, the rate at which the
  model's own layer ran when timed by the plan ([Note: model compute probe] in
  compute_probe.py: the measured seconds, whatever the FLOP count); else the ``"compute":
  {"flops_per_s": ...}`` entry ``tiered bench --json`` writes into the bandwidth file, or
  `probe_flops` run by the plan itself, a timed fp32/bf16 matmul of a fraction of a second on
  this machine's device (neither probe is run when planning for a GPU on a machine without
  one: there compute stays unmodelled, and the plan says so).
  Without the tokens, compute is not modelled (the same for every candidate: the ranking holds,
  the absolute s/step is a floor).

The engine overlaps I/O with compute (prefetch ahead of the forward and backward, the writes
behind). With the optimizer's state prefetched (``offload_optimizer.pipeline_read``) the step
is max(compute, I/O, CPU Adam); on a machine without a GPU the CPU Adam runs on the same cores
as the compute, so there it adds to the compute instead of overlapping it (max(compute + Adam,
I/O)). With the step overlapped with backward (``tiered.overlap_step_with_backward``) the
state's I/O cannot start before backward: [Note: the overlapped step's two phases]. Otherwise
the step starts after backward and first reads its state from disk: those reads, with the
write-backs the pipeline starts while it still reads (one drive does both; measured on
benchmarks/residency_sweep.py, 2026-12-08: 0.59 s of read waits for 0.33 GB read and 0.33 GB
written in the step), or the Adam if slower, run alone after the compute and add to it:
max(compute, the other I/O) + max(state reads + writes, Adam). On a host without a GPU the
"gpu" tier is host memory: its copies are memcpy on the cores that compute, at the host copy rate
`tiered bench` measures, and add to the compute ([Note: host rates measured]). What is not counted: the first group's fetch before the forward can start, the
last writes' wait, and with the matmul probe, the compute's own inefficiency at small shapes
(attention, norms and the loss are not in 6 x params x tokens, and run below one large matmul's
rate; the model probe measures them): benchmarks/RESULTS.md
(issue 21) compares the prediction with benchmarks/step.py's measured s/step.

[Note: the overlapped step's two phases]
With the step overlapped with backward (``tiered.overlap_step_with_backward``) each group's
optimizer step starts when its gradients arrive, so the optimizer state's reads and writes
cannot begin before the (last micro-batch's) backward: the forward overlaps only the parameter
gathers. The step is then forward + backward-with-the-step: max(the compute before the last
backward (`forward_fraction`), the gathers' disk reads) + max(the rest of the disk I/O, the
last backward's compute (+ the Adam on shared cores), the Adam). With ``buffer_count`` 1 the
pipeline's one slot holds a tile from its read through its Adam to its write-back, so the Adam
adds to that I/O instead of hiding under it (`adam_between_read_and_write`). Measured on the
1/20 headline replica (benchmarks/RESULTS.md, 2026-12-05): forward 2.7-4.0 s, backward 31.3 s,
step 1.1 s; the stepper's chain per step: 14.5 s waiting for reads, 2.0 s of Adam, 10.4 s
waiting for write-backs. A single max over the whole step (25.5 s) missed the forward and the
chained Adam, 0.69x of the measured 36.7 s; the two phases predict 28.5 s (0.78x) for it, and
rank ``buffer_count`` 2 first, which the search then chose: measured 30.3 s against 26.9 s
predicted (0.89x).

[Note: compute beside the engine's threads]
On a machine without a GPU the forward and backward run on the cores the engine's own threads
use: the tier manager's I/O workers (O_DIRECT submission, copies into aligned buffers,
checksums), the prefetches, the write-backs and the optimizer's stepper. torch's intra-op pool
is as large as the cores, and an OpenMP-style pool waits at every barrier for its slowest
thread, so one busy engine thread slows every kernel, not only its own share. Measured on
benchmarks/step.py (2 cores, quiet machine, benchmarks/RESULTS.md 2026-12-05): plain PyTorch's
forward + backward 0.43 s with 2 threads and 0.80 s with 1; the same model through the engine
with 2 threads 0.65 s, and its matmul kernels alone as slow as plain PyTorch's whole forward.
So on a CPU-only host both probes (the model's own layer and the matmul) time the compute with
one thread fewer than the process has (`compute_threads_beside_engine`: the engine's threads
take a core), at least one: on 2 cores that is the 1-thread figure, an over-estimate of the
compute that stands in for the engine's CPU work in the forward and backward (gathers into the
"gpu" tier, hooks, I/O submission), which no link term counts there; on many cores it costs a
core's share. A GPU's compute is not affected: its probes are the device's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from tiered.config.schema import TieredConfig
from tiered.optim.arrivals import overlap_blockers

if TYPE_CHECKING:
    from tiered.planning.needs import Prediction

DEFAULT_BANDWIDTH = {"disk_read": 3.0e9, "disk_write": 2.0e9, "h2d": 20e9, "d2h": 20e9, "cpu_adam": 1.0e9}
"""Bytes/s per link and CPU Adam elements/s assumed without ``--bandwidth`` (one PCIe 4.0 NVMe
drive, PCIe 4.0 x16 pinned copies, the AVX2 fused Adam on a few cores): printed as assumptions."""


def read_bandwidth(path: str | Path, what: str = "--bandwidth") -> tuple[dict[str, float], list[str]]:
    """Link bandwidths from `tiered bench --json FILE` output; what was taken from where. A
    ``"compute": {"flops_per_s": F}`` entry, when present, is the FLOP rate ("flops"). `what`
    names the file in errors as the user gave it."""
    from tiered.planning.bench_file import read_bench_json

    doc = read_bench_json(path, what)  # [Note: files a user names]; every rate below checked finite > 0
    methods = doc["methods"]
    bw = dict(DEFAULT_BANDWIDTH)
    said: list[str] = []
    ok = [m for m in methods if m.get("status") == "ok" and m.get("read_gbps") and m.get("write_gbps")]
    # the engine's own nvme backend where the bench ran it (its name: "tiered backend: nvme"),
    # else the fastest method (the O_DIRECT ceiling)
    disk = next((m for m in ok if m.get("name") in ("nvme", "tiered backend: nvme")), None) or max(
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
    adam = doc.get("cpu_adam")  # [Note: host rates measured]
    if isinstance(adam, dict) and "elements_per_s" in adam:  # checked by read_bench_json
        bw["cpu_adam"] = float(adam["elements_per_s"])
        said.append(f"CPU Adam {bw['cpu_adam'] / 1e9:.3f}e9 elements/s ({path})")
    else:
        said.append(f"CPU Adam: not in {path}; assumed {bw['cpu_adam'] / 1e9:.1f}e9 elements/s")
    copy = doc.get("host_copy")
    if isinstance(copy, dict) and "gbps" in copy:
        bw["host_copy"] = float(copy["gbps"]) * 1e9
        said.append(f"host memory copy {_gbps(bw['host_copy'])} ({path})")
    compute = doc.get("compute")
    if isinstance(compute, dict) and isinstance(compute.get("flops_per_s"), (int, float)):
        bw["flops"] = float(compute["flops_per_s"])
        said.append(f"compute {bw['flops'] / 1e12:.2f} TFLOP/s ({path})")
    return bw, said


def _gbps(b: float) -> str:
    return f"{b / 1e9:.1f} GB/s"


def compute_threads_beside_engine(threads: int | None = None) -> int:
    """[Note: compute beside the engine's threads]: the intra-op threads a CPU-only host's compute
    is timed with, of the process's `threads` (default torch's): one fewer, at least one."""
    n = torch.get_num_threads() if threads is None else threads
    return max(1, n - 1)


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[int]:
    """torch's intra-op thread count set to `threads` (None: left alone) for the block, restored
    after; yields the count in force."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def probe_flops(
    device: str = "cpu", dtype: torch.dtype = torch.float32, seconds: float = 0.3, threads: int | None = None
) -> float:
    """The device's matmul rate in FLOP/s: square products timed for about `seconds` (after one
    untimed warm-up), the rate the forward and backward's linear layers run at ([Note: step
    time model]); on a CPU with `threads` intra-op threads (None: torch's). A measurement, not a
    constant: it varies with the load on a shared machine."""
    n = 1024 if device == "cpu" else 4096
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    with intra_op_threads(threads if device == "cpu" else None):
        torch.mm(a, b)
        sync()
        done, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            done += 1
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return 2.0 * n**3 * done / elapsed


def forward_fraction(*, checkpointing: bool = False, accumulation: int = 1) -> float:
    """The share of a step's compute done before its last backward begins ([Note: the overlapped
    step's two phases]): every micro-batch's forward (2 of 6 x params x tokens; 2 of 8 with
    checkpointing, whose recompute is the backward's) and every backward but the last."""
    f = 2 / 8 if checkpointing else 2 / 6
    a = max(1, int(accumulation))
    return 1 - (1 - f) / a


def training_flops(params: int, tokens: int, *, checkpointing: bool = False) -> float:
    """FLOPs of one optimizer step over `tokens` tokens ([Note: step time model]): 6 x params x
    tokens, plus a second forward (2 x params x tokens) with activation checkpointing."""
    return float((8 if checkpointing else 6) * params * tokens)


def seconds_per_step(
    traffic: Mapping[str, int],
    adam_elements: int,
    bw: Mapping[str, float],
    *,
    compute_flops: float = 0.0,
    shared_cores: bool = False,
    step_disk_reads: int = 0,
    step_disk_writes: int = 0,
    host_copies: int = 0,
    state_in_backward: bool = False,
    forward_fraction: float = 1 / 3,
    gather_disk_reads: int = 0,
    adam_in_io_chain: bool = False,
) -> float:
    """[Note: step time model]: the slowest of the overlapped links, the CPU Adam and the
    compute bound the step; with `shared_cores` (no GPU) the Adam adds to the compute.
    `step_disk_reads`: bytes the optimizer step reads from disk after backward has ended (its
    state, when the step is neither overlapped with backward nor ``pipeline_read``): that
    read, with `step_disk_writes` (the state's and parameters' write-backs, which the pipeline
    starts while it still reads, on the same drive), or the Adam if slower, then runs alone and
    adds to the rest. `host_copies`: with `shared_cores`, the bytes copied into and out of the
    "gpu" tier, host memory there: memcpy on the cores that compute, at ``bw["host_copy"]``
    ([Note: host rates measured]), added to the compute. `state_in_backward`:
    the step is overlapped with backward, so its state moves start with backward's first
    gradients ([Note: the overlapped step's two phases]); `forward_fraction` of the compute is
    the forward's, `gather_disk_reads` of the disk reads the parameter gathers'.
    `adam_in_io_chain`: ``buffer_count`` 1, each tile's Adam between its read and its write."""
    adam = adam_elements / bw["cpu_adam"]
    compute = compute_flops / bw["flops"] if compute_flops and bw.get("flops") else 0.0
    if shared_cores and host_copies:
        compute += host_copies / bw.get("host_copy", bw["h2d"])
    chained = adam if adam_in_io_chain else 0.0
    step_disk = step_disk_reads / bw["disk_read"] + step_disk_writes / bw["disk_write"]
    tail = max(step_disk, adam) if step_disk_reads else 0.0
    disk = (traffic["disk->host"] - step_disk_reads) / bw["disk_read"] + (
        traffic["host->disk"] - step_disk_writes
    ) / bw["disk_write"]
    memory_links = max(traffic["host->device"] / bw["h2d"], traffic["device->host"] / bw["d2h"])
    io = max(disk, memory_links)
    if tail:
        return max(io, compute) + tail
    if state_in_backward:
        forward_io = gather_disk_reads / bw["disk_read"]
        forward = max(compute * forward_fraction, forward_io)
        backward_compute = compute * (1 - forward_fraction) + (adam if shared_cores else 0.0)
        return forward + max(disk - forward_io + chained, memory_links, backward_compute, adam)
    if shared_cores:
        return max(io, compute + adam)
    return max(io, adam, compute)


def state_moves_in_backward(cfg: TieredConfig) -> bool:
    """Whether the optimizer's state moves start only with the last backward's gradients: the
    step overlapped with backward ([Note: the overlapped step's two phases])."""
    return bool(cfg.zero.overlap_step_with_backward and not overlap_blockers(cfg))


def adam_between_read_and_write(cfg: TieredConfig) -> bool:
    """``buffer_count`` 1 without ``pipeline_read``: the pipeline's one slot holds a tile from
    its read through its Adam to its write-back, so the Adam is in the I/O's chain."""
    z = cfg.zero.offload_optimizer
    return int(z.buffer_count) <= 1 and not z.pipeline_read


def step_runs_alone(cfg: TieredConfig) -> bool:
    """Whether the optimizer step starts after backward and reads its state then ([Note: step
    time model]): neither overlapped with backward nor its state prefetched (pipeline_read)."""
    overlapped = cfg.zero.overlap_step_with_backward and not overlap_blockers(cfg)
    return not overlapped and not cfg.zero.offload_optimizer.pipeline_read


class StepPrediction(NamedTuple):
    """What `config_seconds_per_step` predicts for one step, with the inputs of its terms."""

    seconds: float
    traffic: dict[str, int]
    """[Note: bytes per step] per link."""
    adam_elements: int
    """Elements the CPU Adam steps."""
    step_state_reads: int
    """Disk bytes the step reads alone after backward (0 where they are prefetched or overlapped)."""


def config_seconds_per_step(
    pred: Prediction,
    cfg: TieredConfig,
    bw: Mapping[str, float],
    *,
    compute_flops: float = 0.0,
    shared_cores: bool = False,
    checkpointing: bool = False,
) -> StepPrediction:
    """`seconds_per_step` of a predicted config with its [Note: bytes per step], every setting
    read from `cfg` and what the faster tiers keep from the prediction's residency ([Note:
    residency]): the one call of `tiered plan`'s search and the benchmarks' predictions."""
    from tiered.planning.traffic import config_bytes_per_step

    traffic = config_bytes_per_step(pred, cfg)
    step_only = config_bytes_per_step(pred, cfg, backward=False)
    state_reads = step_only["disk->host"]
    trainable = [g for g in pred.groups if g.trainable]
    adam = sum(g.shard_numel for g, p in zip(trainable, pred.plans, strict=True) if p.side == "cpu")
    alone = step_runs_alone(cfg)
    step_reads = state_reads if alone else 0
    copies = 0
    if shared_cores and pred.memory.get("gpu") == "host":
        # the same moves with the "gpu" tier counted as a device: its copies ([Note: host rates measured])
        as_device = config_bytes_per_step(
            dataclasses.replace(pred, memory={**pred.memory, "gpu": "device"}), cfg
        )
        copies = as_device["host->device"] + as_device["device->host"]
    seconds = seconds_per_step(
        traffic,
        adam,
        bw,
        compute_flops=compute_flops,
        shared_cores=shared_cores,
        step_disk_reads=step_reads,
        step_disk_writes=step_only["host->disk"] if alone else 0,
        host_copies=copies,
        state_in_backward=state_moves_in_backward(cfg),
        forward_fraction=forward_fraction(
            checkpointing=checkpointing, accumulation=int(cfg.gradient_accumulation_steps)
        ),
        gather_disk_reads=traffic["disk->host"] - state_reads,
        adam_in_io_chain=adam_between_read_and_write(cfg),
    )
    return StepPrediction(seconds, traffic, adam, step_reads)
