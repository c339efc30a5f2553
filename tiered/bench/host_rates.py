"""The host's own rates that `tiered plan`'s step time uses beside the links: the CPU Adam's
elements per second and, on a machine without a GPU, the host memory copy that stands in for
the host<->device link.

[Note: host rates measured]
`tiered plan` ([Note: step time model]) divides the elements the CPU Adam steps by an element
rate, and the bytes moved into and out of the "gpu" tier by a copy rate. Assumed (1e9 elements/s,
20 GB/s), they put the plan 2-3x under the step measured on a 2-core host (benchmarks/RESULTS.md,
issue 41): the fused Adam ran there at a fifth of the assumed rate, and where there is no GPU the
"gpu" tier is host memory, so every gather and gradient hand-off is a memcpy on the cores that
also compute. `tiered bench` therefore times both here and writes them into its JSON
(``"cpu_adam": {"elements_per_s": ...}``, ``"host_copy": {"gbps": ...}``), which
`tiered.planning.timing.read_bandwidth` reads:

* the CPU Adam: the engine's own kernel (``tiered_ext.adam_step``, fp32 master, gradient and both
  moments) on one tile of `ADAM_TILE` elements (a ``sub_group_size`` tile, as the stepper takes
  them), the median of a few rounds after a warm-up, with the process's threads;
* the host copy: ``Tensor.copy_`` between two host buffers of the bench's size (what the engine
  does where the "gpu" tier is host memory), median GB/s over the rounds.

A kernel that cannot be built here is reported absent with the reason: the plan then says it
assumed the rate.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

ADAM_TILE = 1 << 22
"""Elements of the tile the CPU Adam is timed on (16 MiB per fp32 tensor: past the caches, as
the stepper's tiles are)."""


def measure_cpu_adam(rounds: int = 5, numel: int = ADAM_TILE) -> dict[str, Any]:
    """The engine's fused CPU Adam's elements per second here ([Note: host rates measured])."""
    try:
        import tiered_ext
    except Exception as exc:  # noqa: BLE001 - a missing toolchain is reported, the bench goes on
        return {
            "available": False,
            "detail": f"the CPU Adam kernel did not load: {type(exc).__name__}: {exc}",
        }
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen) * 1e-3
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    times = []
    for step in range(1, rounds + 2):
        t0 = time.perf_counter()
        tiered_ext.adam_step(
            master, grad, exp_avg, exp_avg_sq, out_lowp=None, step=step, lr=1e-3, beta1=0.9,
            beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True, grad_scale=1.0,
        )  # fmt: skip
        if step > 1:  # the first round warms the pages and the thread pool
            times.append(time.perf_counter() - t0)
    return {
        "available": True,
        "elements_per_s": numel / statistics.median(times),
        "numel": numel,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
    }


def measure_host_copy(size_bytes: int, rounds: int = 5) -> dict[str, Any]:
    """Host memory copy GB/s (``Tensor.copy_``, `size_bytes` at most 1 GiB) ([Note: host rates
    measured])."""
    n = max(1 << 20, min(size_bytes, 1 << 30))
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the destination's pages before timing
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return {"gbps": n / statistics.median(times) / 1e9, "size_bytes": n, "rounds": rounds}
