"""Builds the native kernels on first use, caches them, and falls back to the reference.

[Note: extension naming and caching]
torch.utils.cpp_extension.load caches a build under TORCH_EXTENSIONS_DIR by extension name. The
name carries a hash of every source file, the compile flags, and the torch and Python versions,
so editing a kernel or upgrading torch builds a fresh extension instead of loading a stale one
(torch's own staleness check only looks at sources it was given, not at the torch that built them).

[Note: fallback, never silent]
If the build fails (no compiler, TIERED_EXT_DISABLE=1, a broken toolchain), the pure-torch
reference runs instead: a KernelBuildWarning is emitted once, an error-level log line names the
cause, and kernel_info() reports "reference (build failed: ...)". Nothing crashes; the slowdown is
announced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from tiered.errors import KernelBuildWarning

log = logging.getLogger("tiered_ext")

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_SOURCES = [
    CSRC / "cpu_adam" / name
    for name in (
        "binding.cpp",
        "dispatch.cpp",
        "cpu_adam_scalar.cpp",
        "cpu_adam_avx2.cpp",
        "cpu_adam_avx512.cpp",
    )
]
COMMON_HEADERS = [CSRC / "common" / "adam_hyper.h"]
CPU_HEADERS = [
    CSRC / "cpu_adam" / name for name in ("cpu_adam.h", "scalar_ops.h", "simd_kernel.h")
] + COMMON_HEADERS
GPU_SOURCES = [CSRC / "gpu_adam" / "binding.cpp", CSRC / "gpu_adam" / "gpu_adam.cu"]
GPU_HEADERS = [CSRC / "gpu_adam" / "gpu_adam.h", *COMMON_HEADERS]

# No -march=native: the ISA is chosen at run time (target pragmas per translation unit), so the
# cached build also runs on an older CPU sharing the cache. -ffp-contract=off: see
# [Note: bitwise-identical paths] in csrc/cpu_adam/scalar_ops.h.
CPU_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fno-math-errno"]
CPU_LDFLAGS = ["-fopenmp"]
GPU_CUDA_CFLAGS = ["-O3", "--fmad=false"]

DISABLE_ENV = "TIERED_EXT_DISABLE"
ISA_ENV = "TIERED_EXT_ISA"

_lock = threading.Lock()
_state: dict[str, tuple[ModuleType | None, str]] = {}


def extension_name(kind: str, sources: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    for path in sources:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    return f"tiered_ext_{kind}_{h.hexdigest()[:16]}"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # The compiler's first error line is the useful part of a long ninja log.
    for line in text:
        if "error" in line.lower() and len(line) < 300:
            return line.strip()
    return (text[-1] if text else type(exc).__name__)[:300]


def _build_cpu() -> tuple[ModuleType | None, str]:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    from torch.utils import cpp_extension

    name = extension_name("cpu", CPU_SOURCES + CPU_HEADERS, CPU_CFLAGS + CPU_LDFLAGS)
    try:
        mod = cpp_extension.load(
            name=name,
            sources=[str(p) for p in CPU_SOURCES],
            extra_include_paths=[str(CSRC / "cpu_adam")],
            extra_cflags=CPU_CFLAGS,
            extra_ldflags=CPU_LDFLAGS,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - a compiler error, a missing toolchain: fall back, loudly
        return None, _short(exc)
    isa = mod.get_isa()
    forced = os.environ.get(ISA_ENV, "")
    if forced:
        try:
            mod.set_isa(forced)
            isa = forced
        except ValueError as exc:
            warnings.warn(f"tiered_ext: ignoring {ISA_ENV}={forced!r} ({exc}); using {isa}", KernelBuildWarning,
                          stacklevel=3)  # fmt: skip
    # A vector path that disagrees with the scalar one on the start-up self-test is not used.
    while isa != "scalar" and mod.self_test(isa) != 0:
        lower = {"avx512": "avx2", "avx2": "scalar"}[isa]
        log.error("tiered_ext: the %s CPU Adam path failed its self-test; using %s", isa, lower)
        warnings.warn(
            f"tiered_ext: the {isa} CPU Adam path failed its self-test against the scalar path; using {lower}",
            KernelBuildWarning,
            stacklevel=3,
        )
        isa = lower
        mod.set_isa(isa)
    return mod, f"native-{isa}"


def _load_once(
    kind: str,
    build: Callable[[], tuple[ModuleType | None, str]],
    report: Callable[[ModuleType | None, str], str],
) -> ModuleType | None:
    """Build or load the `kind` module once per process (thread-safe); `report` logs the outcome
    and returns the status kept for `cpu_status` / `gpu_status`."""
    got = _state.get(kind)
    if got is None:
        with _lock:
            got = _state.get(kind)
            if got is None:
                mod, status = build()
                got = (mod, report(mod, status))
                _state[kind] = got
    return got[0]


def _report_cpu(mod: ModuleType | None, status: str) -> str:
    if mod is not None:
        log.info("tiered_ext: CPU Adam path: %s, %d threads", status, mod.num_threads())
        return status
    status = f"reference (build failed: {status})"
    log.error(
        "tiered_ext: native CPU Adam unavailable (%s); the pure-torch reference runs instead "
        "(several times slower). Install g++ and ninja, or unset %s.",
        status,
        DISABLE_ENV,
    )
    warnings.warn(
        f"tiered_ext: native CPU Adam unavailable: {status}; the pure-torch reference runs "
        f"instead (several times slower). Install g++ and ninja, or unset {DISABLE_ENV}.",
        KernelBuildWarning,
        stacklevel=5,  # _report_cpu <- _load_once <- cpu_module <- tiered_ext.adam_step <- the caller
    )
    return status


def cpu_module() -> ModuleType | None:
    """The native CPU module, built or loaded once per process; None when the build failed."""
    return _load_once("cpu", _build_cpu, _report_cpu)


def cpu_status() -> str:
    cpu_module()
    return _state["cpu"][1]


def _build_gpu() -> tuple[ModuleType | None, str]:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None, "no CUDA torch/GPU here; CPU tensors run the CPU kernel"
    from torch.utils import cpp_extension

    name = extension_name("gpu", GPU_SOURCES + GPU_HEADERS, GPU_CUDA_CFLAGS)
    try:
        mod = cpp_extension.load(
            name=name,
            sources=[str(p) for p in GPU_SOURCES],
            extra_include_paths=[str(CSRC / "gpu_adam")],
            extra_cflags=["-O3"],
            extra_cuda_cflags=GPU_CUDA_CFLAGS,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - as for the CPU build: fall back, loudly
        return None, _short(exc)
    return mod, "native-cuda"


def _report_gpu(mod: ModuleType | None, status: str) -> str:
    if mod is not None:
        log.info("tiered_ext: CUDA Adam path: %s", status)
        return status
    status = f"unavailable ({status})"
    if torch.cuda.is_available():
        warnings.warn(
            f"tiered_ext: CUDA Adam {status}; the pure-torch reference runs on the GPU instead",
            KernelBuildWarning,
            stacklevel=5,  # _report_gpu <- _load_once <- gpu_module <- gpu_adam_step <- the caller
        )
    log.info("tiered_ext: CUDA Adam %s", status)
    return status


def gpu_module() -> ModuleType | None:
    """The native CUDA module, built or loaded once per process; None where there is none."""
    return _load_once("gpu", _build_gpu, _report_gpu)


def gpu_status() -> str:
    gpu_module()
    return _state["gpu"][1]


def set_cpu_isa(name: str) -> str:
    """Selects the CPU Adam vector path ("scalar", "avx2", "avx512"); returns the previous one.

    For tests and benchmarks; the default is the best path this CPU runs (TIERED_EXT_ISA overrides).
    Raises ValueError when the native module is not built or this CPU cannot run `name`.
    """
    mod = cpu_module()
    if mod is None:
        raise ValueError(f"cannot select the {name!r} path: {cpu_status()}")
    previous = str(mod.get_isa())
    mod.set_isa(name)
    return previous
