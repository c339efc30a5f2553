"""The AVX-512 CPU Adam path (csrc/cpu_adam/cpu_adam_avx512.cpp) on any x86-64 CPU, its intrinsics
emulated by SIMDe (tiered_ext/_avx512_emulated.py): bitwise equal to the scalar path and close to the
pure-torch reference on every dtype combination, mode and tail size; bf16 rounding edge cases;
inf/NaN detection. Skips, naming `pip install simde-py`, where SIMDe's headers are absent."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from kernel_support import GRAD_DTYPES, HYPER, OUT_DTYPES, STATE_DTYPES, ref_tol

import tiered_ext
from tiered_ext import _avx512_emulated, _loader

# slow: building the emulated module takes about 50 s; CI runs it in ./dev.sh slow
pytestmark = [pytest.mark.native, pytest.mark.slow]

SIZES = [1, 7, 15, 16, 17, 31, 33, 1037]
GUARD = 37  # elements before and after each buffer: every view starts at an unaligned address
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _id(x) -> str:
    return str(x).replace("torch.", "") if x is not None else "noout"


@pytest.fixture(scope="session")
def emu():
    """The emulated-AVX-512 module, built (or loaded from the kernel cache) once per session."""
    if os.environ.get(_loader.DISABLE_ENV):
        pytest.skip(f"native kernels disabled by {_loader.DISABLE_ENV}")
    try:
        mod = _avx512_emulated.build_cpu_emulated()
    except _avx512_emulated.SimdeMissing as exc:
        pytest.skip(str(exc))  # names `pip install simde-py`
    previous = mod.get_isa()
    yield mod
    mod.set_isa(previous)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaNs compare equal to themselves and -0.0 differs from 0.0."""
    return t.view(_INT_OF[t.element_size()])


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or bool(torch.equal(_bits(a), _bits(b)))


def _guarded(n: int, dtype: torch.dtype, fill: torch.Tensor):
    """(raw bytes, 1-D view of n elements filled with `fill`); the guards hold 0xFF bytes."""
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.full(((n + 2 * GUARD) * esize,), 0xFF, dtype=torch.uint8)
    view = raw.view(dtype)[GUARD : GUARD + n]
    view.copy_(fill)
    return raw, view


def _guards_intact(raw: torch.Tensor, n: int, dtype: torch.dtype) -> bool:
    esize = torch.empty((), dtype=dtype).element_size()
    g = GUARD * esize
    return bool((raw[:g] == 0xFF).all()) and bool((raw[g + n * esize :] == 0xFF).all())


def _step(mod, isa: str, p, g, m, v, out, *, step: int, adamw: bool, wd: float, grad_scale: float = 1.0,
          check_finite: bool = False, **hyper) -> bool:  # fmt: skip
    """One call of the module's adam_step on the `isa` path."""
    mod.set_isa(isa)
    assert mod.get_isa() == isa
    kw = {**HYPER, **hyper}
    scalars = (kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], wd, adamw, grad_scale)
    return bool(mod.adam_step(p, g, m, v, step, *scalars, out, check_finite))


def test_module_is_the_emulated_build(emu) -> None:
    assert emu.emulated() is True
    assert "avx512" in emu.supported_isas()
    emu.set_isa("avx512")
    assert emu.get_isa() == "avx512"


def test_product_build_is_not_emulated() -> None:
    if os.environ.get(_loader.DISABLE_ENV):
        pytest.skip(f"native kernels disabled by {_loader.DISABLE_ENV}")
    mod = _loader.cpu_module()
    assert mod is not None, _loader.cpu_status()
    assert mod.emulated() is False


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_self_test_passes(emu, isa: str) -> None:
    emu.set_isa(isa)
    assert emu.self_test(isa) == 0


def _inputs(n: int, gd, sd, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 0.01).to(sd)
    v = (torch.rand(n, generator=gen) * 1e-4).to(sd)
    grads = []
    for _ in range(3):
        g = torch.randn(n, generator=gen)
        g[::5] = 0.0  # exact zeros and tiny values, as in the C++ self-test
        g[1::7] *= 1e-6
        grads.append(g.to(gd))
    return p, m, v, grads


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize(
    "gd,sd,od",
    list(itertools.product(GRAD_DTYPES, STATE_DTYPES, OUT_DTYPES)),
    ids=_id,
)
def test_avx512_bitwise_scalar_and_close_to_reference(emu, gd, sd, od, adamw: bool, n: int) -> None:
    p, m, v, grads = _inputs(n, gd, sd, seed=1000 + n)
    wd = 0.1 if adamw else 0.01
    # One set of guarded, unaligned buffers per path; the reference works on plain clones.
    bufs = {isa: [_guarded(n, t.dtype, t) for t in (p, m, v)] for isa in ("avx512", "scalar")}
    ref = [p.clone(), m.clone(), v.clone()]
    for step, g in enumerate(grads, start=1):
        graw, gview = _guarded(n, gd, g)
        outs = {}
        for isa in ("avx512", "scalar"):
            (_, kp), (_, km), (_, kv) = bufs[isa]
            out = None
            if od is not None:
                outs[isa] = _guarded(n, od, torch.full((n,), float("nan")))  # poisoned
                out = outs[isa][1]
            found = _step(emu, isa, kp, gview, km, kv, out, step=step, adamw=adamw, wd=wd, grad_scale=0.5)
            assert found is False
        out_ref = torch.empty(n, dtype=od) if od is not None else None
        tiered_ext.adam_step_reference(ref[0], g, ref[1], ref[2], step=step, weight_decay=wd, adamw_mode=adamw,
                                       grad_scale=0.5, out_lowp=out_ref, **HYPER)  # fmt: skip
        assert torch.equal(_bits(gview), _bits(g)), "grad was modified"
        assert _guards_intact(graw, n, gd)
        for name, i in (("param", 0), ("exp_avg", 1), ("exp_avg_sq", 2)):
            (ra, a), (rb, b) = bufs["avx512"][i], bufs["scalar"][i]
            assert _same_bits(a, b), f"step {step}: avx512 {name} differs from scalar"
            assert _guards_intact(ra, n, a.dtype), f"avx512 wrote outside {name}"
            assert _guards_intact(rb, n, b.dtype), f"scalar wrote outside {name}"
        if od is not None:
            (ra, a), (rb, b) = outs["avx512"], outs["scalar"]
            assert not a.isnan().any(), "an out_lowp element was not written"
            assert _same_bits(a, b), f"step {step}: avx512 out_lowp differs from scalar"
            assert _guards_intact(ra, n, od), "avx512 wrote outside out_lowp"
            # The low-precision copy is exactly the new master rounded to nearest even.
            assert _same_bits(a, bufs["avx512"][0][1].to(od))
    kp, km, kv = (view for _, view in bufs["avx512"])
    torch.testing.assert_close(kp, ref[0], **ref_tol(sd))
    torch.testing.assert_close(km.float(), ref[1].float(), **ref_tol(sd))
    torch.testing.assert_close(kv.float(), ref[2].float(), rtol=ref_tol(sd)["rtol"] * 10, atol=1e-9)


# fp32 bit patterns around bf16 rounding: ties (to even, down and up), one ulp either side of a tie,
# a carry into the exponent, overflow to inf on a tie and above, subnormals (one a tie), +-0.0,
# infinities and NaNs of both signs, quiet and signalling, one whose rounding add would carry into
# the sign bit (0x7FFF8000).
EDGE_BITS = [
    0x00000000, 0x80000000, 0x3F800000, 0x40490FDB, 0xC0490FDB,
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F808001, 0x3F807FFF, 0x3F80FFFF, 0x3F7FFFFF,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x7F7F7FFF,
    0x00000001, 0x00008000, 0x00018000, 0x00010000, 0x007FFFFF, 0x80000001, 0x807FFFFF, 0x80018000,
    0x00800000, 0x80800000,
    0x7F800000, 0xFF800000,
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7F808000,
]  # fmt: skip


def _bf16_rne_bits(u: int) -> int:
    """c10::BFloat16's conversion (round to nearest even, NaN -> 0x7FC0), in plain Python."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _as_f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(
        torch.float32
    )


@pytest.mark.parametrize("shift", [0, 5, 16], ids=lambda s: f"shift{s}")
def test_bf16_out_rounding_edge_cases(emu, shift: int) -> None:
    """lr=0 leaves each master as it is, so out_lowp must hold exactly its bf16 rounding; each
    pattern sits at several lane positions of the vector body (shifted per case) and in the tail."""
    tiled = (EDGE_BITS * 3)[shift:]
    n = len(tiled)
    p = _as_f32(tiled)
    g, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    want = torch.tensor([_bf16_rne_bits(b) for b in tiled], dtype=torch.int32)
    res = {}
    for isa in ("avx512", "scalar"):
        (_, kp), (_, km), (_, kv) = (_guarded(n, t.dtype, t) for t in (p, m, v))
        rout, out = _guarded(n, torch.bfloat16, torch.full((n,), 1.5))
        _step(emu, isa, kp, g, km, kv, out, step=1, adamw=True, wd=0.0, lr=0.0)
        assert _guards_intact(rout, n, torch.bfloat16)
        got = _bits(out).to(torch.int32) & 0xFFFF
        bad = [(hex(tiled[i]), hex(int(got[i])), hex(int(want[i]))) for i in range(n) if got[i] != want[i]]
        assert not bad, f"{isa}: (fp32 bits, bf16 got, bf16 want): {bad[:8]}"
        finite_or_inf = ~p.isnan()
        assert _same_bits(kp[finite_or_inf], p[finite_or_inf]), "lr=0 changed a master"
        res[isa] = (kp, km, kv, out)
    for a, b in zip(res["avx512"], res["scalar"], strict=True):
        assert _same_bits(a, b)
    # The Python rounding above is torch's own on everything but NaN.
    finite_or_inf = ~p.isnan()
    assert torch.equal(
        want[finite_or_inf], _bits(p[finite_or_inf].to(torch.bfloat16)).to(torch.int32) & 0xFFFF
    )


@pytest.mark.parametrize("od", OUT_DTYPES[1:], ids=_id)
@pytest.mark.parametrize("sd", STATE_DTYPES, ids=_id)
@pytest.mark.parametrize("gd", GRAD_DTYPES, ids=_id)
def test_edge_values_through_every_store_match_scalar(emu, gd, sd, od) -> None:
    """Edge patterns as gradients and masters (so through the grad loads, both state stores and the
    out store, NaN and inf included, with check_finite off): avx512 gives the scalar path's bits."""
    n = 3 * len(EDGE_BITS) + 5
    e = _as_f32((EDGE_BITS * 4)[:n])
    g = e.to(gd) if gd == torch.float32 else (e * 1e-30).to(gd)  # lowp grads: keep some finite
    p = torch.roll(e, 7).clone()
    m = (torch.roll(e, 3) * 1e-3).to(sd)
    v = (torch.roll(e, 11).abs()).to(sd)
    res = {}
    for isa in ("avx512", "scalar"):
        kp, km, kv = p.clone(), m.clone(), v.clone()
        out = torch.full((n,), 1.5, dtype=od)
        _step(emu, isa, kp, g, km, kv, out, step=3, adamw=False, wd=0.01, grad_scale=0.75)
        res[isa] = (kp, km, kv, out)
    for name, a, b in zip(
        ("param", "exp_avg", "exp_avg_sq", "out"), res["avx512"], res["scalar"], strict=True
    ):
        # NaNs included: fp16 copies keep the payload on both paths (scalar_ops.h f32_to_f16).
        assert _same_bits(a, b), f"avx512 {name} differs from scalar"


@pytest.mark.parametrize("gd", GRAD_DTYPES, ids=_id)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_check_finite_sees_every_lane(emu, gd, bad: float) -> None:
    """One bad element at each position of 3 vectors and a tail: found, and nothing is modified."""
    n = 3 * 16 + 5
    gen = torch.Generator().manual_seed(21)
    p0, m0, v0 = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    clean = torch.randn(n, generator=gen).to(gd)
    out0 = torch.full((n,), 2.0, dtype=torch.bfloat16)
    for where in range(n):
        g = clean.clone()
        g[where] = bad
        graw, gview = _guarded(n, gd, g)
        p, m, v, out = p0.clone(), m0.clone(), v0.clone(), out0.clone()
        assert _step(emu, "avx512", p, gview, m, v, out, step=1, adamw=True, wd=0.1, check_finite=True)
        for a, b in zip((p, m, v, out), (p0, m0, v0, out0), strict=True):
            assert _same_bits(a, b), f"modified with a bad grad at {where}"
    p = p0.clone()
    assert not _step(emu, "avx512", p, clean, m0.clone(), v0.clone(), None, step=1, adamw=True, wd=0.1,
                     check_finite=True)  # fmt: skip
    assert not torch.equal(p, p0)


@pytest.mark.parametrize(
    "gd,big,scale",
    [(torch.float16, 60000.0, 1e35), (torch.bfloat16, 3e38, 2.0), (torch.float32, 3e38, 2.0)],
    ids=["fp16", "bf16", "fp32"],
)
@pytest.mark.parametrize("where", [0, 21, 40], ids=["lane0", "lane5-of-2nd", "tail"])
def test_check_finite_sees_overflow_after_scaling(emu, gd, big: float, scale: float, where: int) -> None:
    n = 41
    g = torch.linspace(-1, 1, n).to(gd)
    g[where] = big
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    assert _step(
        emu, "avx512", p, g, m, v, None, step=1, adamw=True, wd=0.0, grad_scale=scale, check_finite=True
    )
    assert not _step(emu, "avx512", p, g, m, v, None, step=1, adamw=True, wd=0.0, grad_scale=1.0,
                     check_finite=True)  # fmt: skip


@pytest.mark.parametrize("where", [0, 70_000, 131_074], ids=["first", "second-block", "last"])
def test_check_finite_across_blocks(emu, where: int) -> None:
    """Past one 64 Ki-element block the check runs per block (and per thread)."""
    n = 131_072 + 3
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    p0 = p.clone()
    assert not _step(emu, "avx512", p.clone(), g, m.clone(), v.clone(), None, step=1, adamw=True, wd=0.0,
                     check_finite=True)  # fmt: skip
    g[where] = float("nan")
    assert _step(emu, "avx512", p, g, m, v, None, step=1, adamw=True, wd=0.0, check_finite=True)
    assert _same_bits(p, p0)
