"""Builds the native kernels on first use, caches them, and falls back to the reference.

[Note: extension naming and caching]
Each kernel is built in a folder of its own, `<cache>/<kind>-<key>`, named `tiered_ext_<kind>_<key>`;
the key hashes every source file, the compile flags and the build environment (torch, compiler,
Python environment, source folder), so editing a kernel or upgrading torch builds a fresh extension
instead of loading a stale one, and two environments never rebuild each other's ([Note: one kernel
cache per environment] in _cache.py). A build that has to compile is announced before it starts
and when it ends (it takes minutes); `tiered build-ext` does it ahead of time.

[Note: fallback, never silent]
If the build fails (no compiler, TIERED_EXT_DISABLE=1, a broken toolchain), the pure-torch
reference runs instead: a KernelBuildWarning is emitted once, an error-level log line names the
cause, and kernel_info() reports "reference (build failed: ...)". Nothing crashes; the slowdown is
announced.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from tiered.errors import KernelBuildWarning

from ._cache import BuildEnvironment, build_key, build_lock, cache_root, is_built

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
        "state_codecs_binding.cpp",
        "state_codecs_scalar.cpp",
        "state_codecs_avx2.cpp",
        "state_codecs_avx512.cpp",
    )
]
COMMON_HEADERS = [CSRC / "common" / "adam_hyper.h"]
CPU_HEADERS = [
    CSRC / "cpu_adam" / name
    for name in ("cpu_adam.h", "scalar_ops.h", "simd_kernel.h", "state_codecs.h", "state_codecs_kernel.h")
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


def extension_name(
    kind: str, sources: list[Path], flags: list[str], env: BuildEnvironment | None = None
) -> str:
    """The module name of a `kind` build: `tiered_ext_<kind>_<key>` ([Note: extension naming and caching])."""
    env = env if env is not None else BuildEnvironment.current(CSRC)
    return f"tiered_ext_{kind}_{build_key(sources, flags, env)}"


def build_dir(kind: str, name: str) -> Path:
    """The cache folder of the build `name` (see extension_name)."""
    return cache_root() / f"{kind}-{name.rsplit('_', 1)[-1]}"


def cpu_build() -> tuple[str, Path]:
    """(module name, build folder) of the CPU Adam in this environment."""
    name = extension_name("cpu", CPU_SOURCES + CPU_HEADERS, CPU_CFLAGS + CPU_LDFLAGS)
    return name, build_dir("cpu", name)


# What each kind is called in the build announcement.
_TITLES = {
    "cpu": "tiered's CPU Adam kernel",
    "gpu": "tiered's CUDA Adam kernel",
    "cpuemu": "tiered's CPU Adam kernel with AVX-512 emulated (tests)",
}


def load_extension(kind: str, name: str, verbose: bool = False, **kwargs: object) -> ModuleType:
    """cpp_extension.load into this environment's cache folder, under the build lock, announced
    when it compiles ([Note: the build lock] in _cache.py)."""
    from torch.utils import cpp_extension

    where = build_dir(kind, name)
    title = _TITLES[kind]
    with build_lock(where, title):
        compiles = not is_built(where, name)
        if compiles:
            # WARNING, not INFO: a pause of minutes nobody was told about reads as a hang.
            log.warning("building %s, once per environment, ~1-4 min (into %s)", title, where)
        t0 = time.perf_counter()
        # copies: torch appends its own flags to the lists it is given, which would change the
        # flags (and so the key, hence the folder) this process computes for its next look-up
        given = {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        mod: ModuleType = cpp_extension.load(name=name, build_directory=str(where), verbose=verbose, **given)  # type: ignore[arg-type]
        if compiles:
            log.warning(
                "built %s in %.0f s; later runs in this environment load it", title, time.perf_counter() - t0
            )
    return mod


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
    name, _ = cpu_build()
    try:
        mod = load_extension(
            "cpu",
            name,
            sources=[str(p) for p in CPU_SOURCES],
            extra_include_paths=[str(CSRC / "cpu_adam")],
            extra_cflags=CPU_CFLAGS,
            extra_ldflags=CPU_LDFLAGS,
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
    from torch.utils.cpp_extension import CUDA_HOME

    # the CUDA toolkit is part of what the binary depends on, as the C++ compiler is
    name = extension_name("gpu", GPU_SOURCES + GPU_HEADERS, [*GPU_CUDA_CFLAGS, f"CUDA_HOME={CUDA_HOME}"])
    try:
        mod = load_extension(
            "gpu",
            name,
            sources=[str(p) for p in GPU_SOURCES],
            extra_include_paths=[str(CSRC / "gpu_adam")],
            extra_cflags=["-O3"],
            extra_cuda_cflags=GPU_CUDA_CFLAGS,
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
