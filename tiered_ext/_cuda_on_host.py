"""The CUDA Adam kernel's body run on the host, for machines without a GPU (tests only).

gpu_adam.cu built with -DTIERED_GPU_ADAM_HOST_EMULATION exports tiered_gpu_adam_emulate(), which
runs every (block, thread) of the launch the binding would make, in a host loop, over the same
chunk table and scalars ([Note: the kernel body on the host] in csrc/gpu_adam/gpu_adam.cu). nvcc
builds it once into the kernel cache (tiered_ext/_cache.py), under a name that hashes the sources, the flags and
nvcc's version. What this checks: the kernel's indexing, dtype dispatch and per-element arithmetic.
What it cannot: the launch, device memory and the intrinsics themselves, which need a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence

import torch
from typing_extensions import Unpack

from . import _loader
from ._cache import cache_root
from ._gpu import check_lists
from ._validate import AdamScalars

SOURCE = _loader.CSRC / "gpu_adam" / "gpu_adam.cu"
HEADERS = _loader.GPU_HEADERS
# The device kernel's flags, plus -ffp-contract=off for the host pass (see the Rn ops in the .cu).
FLAGS = [*_loader.GPU_CUDA_CFLAGS, "-Xcompiler", "-ffp-contract=off", "-Xcompiler", "-fPIC", "-shared",
         "-arch=sm_80", "-DTIERED_GPU_ADAM_HOST_EMULATION"]  # fmt: skip

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, None: 3}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class CudaOnHostUnavailable(RuntimeError):
    """nvcc is missing or failed to build the host emulation."""


class _TensorDesc(ctypes.Structure):
    # Mirrors tiered::gpu_adam::TensorDesc (gpu_adam.h).
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("n", ctypes.c_int64),
    ]


def _build() -> ctypes.CDLL:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CudaOnHostUnavailable("nvcc not found on PATH: the CUDA kernel's host emulation needs it")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    h = hashlib.sha256()
    for path in [SOURCE, *HEADERS]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(version.encode())
    root = cache_root()  # the product kernels' cache ([Note: one kernel cache per environment])
    target = root / f"tiered_ext_cuda_on_host_{h.hexdigest()[:16]}" / "gpu_adam_host.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        cmd = [nvcc, *FLAGS, f"-I{SOURCE.parent}", str(SOURCE), "-o", str(partial)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise CudaOnHostUnavailable(f"nvcc failed to build the host emulation:\n{proc.stderr[-3000:]}")
        os.replace(partial, target)  # atomic: a concurrent loader never sees a half-written library
    lib = ctypes.CDLL(str(target))
    fn = lib.tiered_gpu_adam_emulate
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.POINTER(_TensorDesc), ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int64, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                   ctypes.c_double, ctypes.c_int, ctypes.c_double]  # fmt: skip
    return lib


def library() -> ctypes.CDLL:
    """The host-emulation library, built on first use; raises CudaOnHostUnavailable."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _build()
        return _lib


def gpu_adam_step_on_host(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    out_lowp: Sequence[torch.Tensor] | None = None,
    **hyper: Unpack[AdamScalars],
) -> int:
    """gpu_adam_step's one-group launch, emulated on CPU tensors; returns the number of chunks run.

    All tensors share one (grad, state, out) dtype triple, as within one launch of the binding.
    """
    outs, bound = check_lists(
        params, grads, exp_avgs, exp_avg_sqs, out_lowp, device_type="cpu", step=step, hyper=hyper
    )
    n = len(params)
    if n == 0:
        return 0
    descs = (_TensorDesc * n)()

    def dtypes(i: int) -> tuple[torch.dtype, torch.dtype, torch.dtype | None]:
        out = outs[i]
        return grads[i].dtype, exp_avgs[i].dtype, out.dtype if out is not None else None

    first = dtypes(0)
    for i in range(n):
        key = dtypes(i)
        if key != first:
            raise ValueError(
                f"tensor [{i}] has dtypes {key}, tensor [0] {first}: one launch takes one triple"
            )
        out = outs[i]
        descs[i] = _TensorDesc(params[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(),
                               exp_avg_sqs[i].data_ptr(), out.data_ptr() if out is not None else None,
                               params[i].numel())  # fmt: skip
    return int(
        library().tiered_gpu_adam_emulate(
            descs, n, _CODES[first[0]], _CODES[first[1]], _CODES[first[2]], int(step), bound.lr, bound.beta1,
            bound.beta2, bound.eps, bound.weight_decay, int(bound.adamw_mode), bound.grad_scale,
        )
    )  # fmt: skip
