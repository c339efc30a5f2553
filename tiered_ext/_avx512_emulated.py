"""Test-only: the CPU Adam extension built with its AVX-512 path emulated in portable code.

    build_cpu_emulated() -> module

The same sources and flags as the product build (_loader._build_cpu) plus -DTIERED_SIMD_EMULATION
and SIMDe's include directory (pip package simde-py): cpu_adam_avx512.cpp then includes
csrc/cpu_adam/simd_emulation.h instead of <immintrin.h> and drops its target pragma, and the
dispatcher reports AVX-512 as supported, so set_isa("avx512") runs the AVX-512 Vec and the shared
vector body on any x86-64 CPU (slowly). The module's emulated() returns True.

Never imported by the product code: tests/test_kernel_avx512_emulated.py uses it. The build is
cached in the environment's kernel cache under its own name ([Note: extension naming and caching]
in _loader.py; the name also covers simd_emulation.h and the SIMDe version).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from types import ModuleType

from . import _loader

EMULATION_HEADER = _loader.CSRC / "cpu_adam" / "simd_emulation.h"
EMULATION_CFLAGS = ["-DTIERED_SIMD_EMULATION"]
INSTALL_HINT = "pip install simde-py"


class SimdeMissing(ImportError):
    """SIMDe's headers (pip package simde-py) are not installed."""


def simde_include_dir() -> Path:
    """The directory that holds simde/x86/avx512.h, from the simde-py package."""
    try:
        import simde_py
    except ImportError as exc:
        raise SimdeMissing(
            f"the emulated AVX-512 build needs SIMDe's headers: {INSTALL_HINT} (or ./dev.sh test)"
        ) from exc
    getter = getattr(simde_py, "get_include", None)
    inc = Path(getter()) if getter is not None else Path(simde_py.__file__).resolve().parent / "simde"
    if not (inc / "simde" / "x86" / "avx512.h").is_file():
        raise SimdeMissing(f"simde-py is installed but {inc}/simde/x86/avx512.h is missing: {INSTALL_HINT}")
    return inc


def _simde_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("simde-py")
    except metadata.PackageNotFoundError:
        return "unknown"


_lock = threading.Lock()


@functools.cache
def _build(verbose: bool) -> ModuleType:
    inc = simde_include_dir()
    cflags = _loader.CPU_CFLAGS + EMULATION_CFLAGS
    # The include directory and SIMDe's version take part in the name (only the hash, not the command).
    hashed_flags = cflags + _loader.CPU_LDFLAGS + [f"-I{inc}", f"simde-py=={_simde_version()}"]
    name = _loader.extension_name(
        "cpuemu", _loader.CPU_SOURCES + _loader.CPU_HEADERS + [EMULATION_HEADER], hashed_flags
    )
    return _loader.load_extension(
        "cpuemu",
        name,
        sources=[str(p) for p in _loader.CPU_SOURCES],
        extra_include_paths=[str(_loader.CSRC / "cpu_adam"), str(inc)],
        extra_cflags=cflags,
        extra_ldflags=_loader.CPU_LDFLAGS,
        verbose=verbose,
    )


def build_cpu_emulated(verbose: bool = False) -> ModuleType:
    """Builds (or loads from the cache) the emulated-AVX-512 CPU module; once per process.

    Raises SimdeMissing (an ImportError naming `pip install simde-py`) when SIMDe is absent, and
    whatever torch.utils.cpp_extension raises when the compile fails (no fallback: a test module).
    """
    with _lock:
        return _build(verbose)
