"""What the CPU Adam kernel tests share: the dtype grid, the step scalars and the tolerances
against the pure-torch reference (tests/test_kernel_cpu_adam.py, tests/test_kernel_avx512_emulated.py)."""

from __future__ import annotations

import torch

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STATE_DTYPES = [torch.float32, torch.bfloat16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def ref_tol(sd: torch.dtype) -> dict[str, float]:
    """Tolerance of a kernel's state against the reference's: fp32, a few ulps; bf16 states, one bf16
    ulp (2^-8 relative), which can flip when the fp32 values differ by an ulp near a rounding
    boundary (it moves the parameter by < lr/100)."""
    return dict(rtol=1e-6, atol=1e-7) if sd == torch.float32 else dict(rtol=1e-5, atol=1e-4)
