"""gpu_adam_step: CPU lists run the CPU kernel; on a GPU machine (marked cuda) the multi-tensor
CUDA kernel matches the reference and the CPU kernel."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

import tiered_ext

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
SIZES = [1, 7, 16, 17, 16384, 16385, 100_003]


def _group(sizes, gd, sd, od, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=gen) for n in sizes]
    gs = [torch.randn(n, generator=gen).to(gd) for n in sizes]
    ms = [(torch.randn(n, generator=gen) * 0.01).to(sd) for n in sizes]
    vs = [(torch.rand(n, generator=gen) * 1e-4).to(sd) for n in sizes]
    outs = [torch.full((n,), float("nan"), dtype=od) for n in sizes] if od is not None else None
    move = lambda ts: [t.to(device) for t in ts] if ts is not None else None  # noqa: E731
    return move(ps), move(gs), move(ms), move(vs), move(outs)


def test_cpu_lists_match_per_tensor_adam_step() -> None:
    a = _group(SIZES, torch.bfloat16, torch.float32, torch.bfloat16, "cpu")
    b = [[t.clone() for t in ts] if ts is not None else None for ts in a]
    for step in (1, 2):
        tiered_ext.gpu_adam_step(*a[:4], out_lowp=a[4], step=step, grad_scale=0.5, **HYPER)
        for i in range(len(SIZES)):
            tiered_ext.adam_step(b[0][i], b[1][i], b[2][i], b[3][i], out_lowp=b[4][i], step=step, grad_scale=0.5,
                                 **HYPER)  # fmt: skip
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            assert torch.equal(s, t)


def test_bad_lists_are_clear_value_errors() -> None:
    p, g, m, v, _ = _group([4, 5], torch.float32, torch.float32, None, "cpu")
    with pytest.raises(ValueError, match="grads has 1 tensors but params has 2"):
        tiered_ext.gpu_adam_step(p, g[:1], m, v, step=1, **HYPER)
    with pytest.raises(ValueError, match=r"exp_avgs?\[1\] has 4 elements|exp_avg\[1\] has 4 elements"):
        tiered_ext.gpu_adam_step(p, g, [m[0], m[0]], v, step=1, **HYPER)
    with pytest.raises(ValueError, match="eps must be"):
        tiered_ext.gpu_adam_step(p, g, m, v, step=1, **{**HYPER, "eps": 0.0})
    tiered_ext.gpu_adam_step([], [], [], [], step=1, **HYPER)  # an empty group is a no-op


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_kernel_is_built() -> None:
    assert tiered_ext.kernel_info()["gpu_adam"] == "native-cuda"


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "gd,sd,od,adamw",
    list(itertools.product([torch.float32, torch.bfloat16, torch.float16], [torch.float32, torch.bfloat16],
                           [None, torch.bfloat16, torch.float16], [True, False])),
)  # fmt: skip
def test_cuda_matches_cpu_kernel_and_reference(gd, sd, od, adamw: bool) -> None:
    gpu = _group(SIZES, gd, sd, od, "cuda", seed=3)
    cpu = _group(SIZES, gd, sd, od, "cpu", seed=3)
    ref = _group(SIZES, gd, sd, od, "cpu", seed=3)
    for step in (1, 2, 3):
        kw = dict(step=step, grad_scale=0.5, adamw_mode=adamw, **HYPER)
        tiered_ext.gpu_adam_step(*gpu[:4], out_lowp=gpu[4], **kw)
        tiered_ext.gpu_adam_step(*cpu[:4], out_lowp=cpu[4], **kw)
        for i in range(len(SIZES)):
            tiered_ext.adam_step_reference(ref[0][i], ref[1][i], ref[2][i], ref[3][i],
                                           out_lowp=ref[4][i] if od is not None else None, **kw)  # fmt: skip
    torch.cuda.synchronize()
    for k in (0, 2, 3, 4):
        if gpu[k] is None:
            continue
        for i in range(len(SIZES)):
            got = gpu[k][i].cpu()
            # Same operation sequence as the CPU kernel ([Note: bitwise-identical paths]): equal bits.
            assert torch.equal(got, cpu[k][i]), f"buffer {k} tensor {i} differs from the CPU kernel"
            tol = dict(rtol=1e-6, atol=2e-7) if sd == torch.float32 else dict(rtol=1e-5, atol=1e-4)
            if k != 4:
                torch.testing.assert_close(got.float(), ref[k][i].float(), **tol)


# The kernel body on the host ([Note: the kernel body on the host] in csrc/gpu_adam/gpu_adam.cu):
# every (block, thread) of the launch, run in a host loop, against the CPU kernel, bit for bit.
# Runs wherever nvcc is, GPU or not; the launch itself is only checked by the cuda tests above.
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found on PATH: the CUDA kernel's host emulation needs it"
)
HOST_SIZES = [1, 7, 255, 256, 257, 16383, 16384, 16385, 2 * 16384 + 300]


def _guarded_group(sizes, gd, sd, od, seed: int, guard: int = 41):
    """_group's tensors as views inside buffers whose guard regions hold a sentinel pattern."""
    tensors = _group(sizes, gd, sd, od, "cpu", seed=seed)
    guarded, raws = [], []
    for ts in tensors:
        if ts is None:
            guarded.append(None)
            continue
        views = []
        for t in ts:
            raw = torch.full((t.numel() + 2 * guard,), -7.0).to(t.dtype)
            raw[guard : guard + t.numel()] = t
            views.append(raw[guard : guard + t.numel()])
            raws.append((raw, guard, t.numel()))
        guarded.append(views)
    return guarded, raws


def _guards_hold(raws) -> bool:
    return all(bool((raw[:g] == -7.0).all()) and bool((raw[g + n :] == -7.0).all()) for raw, g, n in raws)


@needs_nvcc
@pytest.mark.native
@pytest.mark.parametrize(
    "gd,sd,od,adamw",
    list(itertools.product([torch.float32, torch.bfloat16, torch.float16], [torch.float32, torch.bfloat16],
                           [None, torch.bfloat16, torch.float16], [True, False])),
)  # fmt: skip
def test_cuda_kernel_body_on_host_matches_cpu_kernel(gd, sd, od, adamw: bool) -> None:
    from tiered_ext import _cuda_on_host

    emu, raws = _guarded_group(HOST_SIZES, gd, sd, od, seed=5)
    cpu = _group(HOST_SIZES, gd, sd, od, "cpu", seed=5)
    expected_chunks = sum(-(-n // 16384) for n in HOST_SIZES)
    for step in (1, 2, 3):
        kw = dict(step=step, grad_scale=0.5, adamw_mode=adamw, **HYPER)
        assert _cuda_on_host.gpu_adam_step_on_host(*emu[:4], out_lowp=emu[4], **kw) == expected_chunks
        tiered_ext.gpu_adam_step(*cpu[:4], out_lowp=cpu[4], **kw)  # CPU lists: the CPU kernel
    for k in (0, 2, 3, 4):
        if emu[k] is None:
            continue
        for i, n in enumerate(HOST_SIZES):
            assert torch.equal(emu[k][i], cpu[k][i]), (
                f"buffer {k} tensor {i} (n={n}) differs from the CPU kernel"
            )
    assert _guards_hold(raws), "the kernel wrote outside a tensor"


@needs_nvcc
@pytest.mark.native
def test_cuda_kernel_body_on_host_writes_every_output_element() -> None:
    from tiered_ext import _cuda_on_host

    p, g, m, v, out = _group(HOST_SIZES, torch.bfloat16, torch.float32, torch.bfloat16, "cpu", seed=9)
    assert all(bool(o.isnan().all()) for o in out)  # poisoned by _group
    _cuda_on_host.gpu_adam_step_on_host(p, g, m, v, out_lowp=out, step=1, **HYPER)
    for i, (o, q) in enumerate(zip(out, p, strict=True)):
        assert torch.equal(o, q.to(torch.bfloat16)), f"out_lowp[{i}] is not the new parameter's bf16 copy"
