"""The native fused CPU Adam against the pure-torch reference (and torch.optim) on every dtype
combination, tail size and vector path; inf/NaN detection; threads; conversions; bad input."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from kernel_support import GRAD_DTYPES, HYPER, OUT_DTYPES, STATE_DTYPES, ref_tol

import tiered_ext
from tiered_ext import _loader

pytestmark = pytest.mark.native

SIZES = [1, 7, 15, 16, 17, 1037]


def _native_or_fail() -> None:
    if os.environ.get(_loader.DISABLE_ENV):
        pytest.skip(f"native kernels disabled by {_loader.DISABLE_ENV}")
    status = tiered_ext.kernel_info()["cpu_adam"]
    assert str(status).startswith("native"), f"the native CPU Adam did not build here: {status}"


@pytest.fixture(params=["best", "scalar"])
def isa(request: pytest.FixtureRequest):
    """Runs a test on the best vector path and on the scalar path."""
    _native_or_fail()
    mod = _loader.cpu_module()
    name = mod.get_isa() if request.param == "best" else "scalar"
    previous = _loader.set_cpu_isa(name)
    yield name
    _loader.set_cpu_isa(previous)


def _guarded(n: int, dtype: torch.dtype, fill: torch.Tensor | None = None, guard: int = 37):
    """A 1-D view of n elements inside a buffer whose guard regions hold 0xFF bytes."""
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.full(((n + 2 * guard) * esize,), 0xFF, dtype=torch.uint8)
    whole = raw.view(dtype)
    view = whole[guard : guard + n]
    if fill is not None:
        view.copy_(fill)
    return raw, view, guard * esize


def _guards_intact(raw: torch.Tensor, n: int, dtype: torch.dtype, gbytes: int) -> bool:
    esize = torch.empty((), dtype=dtype).element_size()
    return bool((raw[:gbytes] == 0xFF).all()) and bool((raw[gbytes + n * esize :] == 0xFF).all())


def _make(n: int, gd: torch.dtype, sd: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 0.01).to(sd)
    v = (torch.rand(n, generator=gen) * 1e-4).to(sd)
    grads = [torch.randn(n, generator=gen).to(gd) for _ in range(3)]
    return p, m, v, grads


# Parameters are O(1): a few ulps at unit scale absolute (an element near 0 that took 100 updates
# carries the ulps of those updates), 1e-6 relative otherwise.
P_TOL = dict(rtol=1e-6, atol=2e-7)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize(
    "gd,sd,od",
    list(itertools.product(GRAD_DTYPES, STATE_DTYPES, OUT_DTYPES)),
    ids=lambda x: str(x).replace("torch.", "") if x is not None else "noout",
)
def test_matches_reference(isa: str, gd, sd, od, adamw: bool, n: int) -> None:
    p, m, v, grads = _make(n, gd, sd, seed=n)
    ref = [p.clone(), m.clone(), v.clone()]
    raws = [_guarded(n, t.dtype, t) for t in (p, m, v)]
    (rp, kp, gp), (rm, km, gm), (rv, kv, gv) = raws
    wd = 0.1 if adamw else 0.01
    for step, g in enumerate(grads, start=1):
        kw = dict(step=step, weight_decay=wd, adamw_mode=adamw, grad_scale=0.5, **HYPER)
        out = out_ref = None
        if od is not None:
            rout, out, gout = _guarded(n, od, torch.full((n,), float("nan")))  # poisoned
            out_ref = torch.empty(n, dtype=od)
        graw, gview, ggrd = _guarded(n, gd, g)
        assert tiered_ext.adam_step(kp, gview, km, kv, out_lowp=out, **kw) is False
        assert tiered_ext.adam_step_reference(ref[0], g, ref[1], ref[2], out_lowp=out_ref, **kw) is False
        assert torch.equal(gview, g), "grad was modified"
        if od is not None:
            assert not out.isnan().any(), "an out_lowp element was not written"
            assert _guards_intact(rout, n, od, gout)
            # The low-precision copy is exactly the new master rounded to nearest even.
            assert torch.equal(out, kp.to(od))
        for raw, t, gb in ((rp, kp, gp), (rm, km, gm), (rv, kv, gv)):
            assert _guards_intact(raw, n, t.dtype, gb), "write outside the partition"
        assert _guards_intact(graw, n, gd, ggrd)
    torch.testing.assert_close(kp, ref[0], **ref_tol(sd))
    torch.testing.assert_close(km.float(), ref[1].float(), **ref_tol(sd))
    torch.testing.assert_close(kv.float(), ref[2].float(), rtol=ref_tol(sd)["rtol"] * 10, atol=1e-9)


def _run_steps(n: int, steps: int, gd, sd, od, adamw: bool, fn, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n, dtype=sd)
    v = torch.zeros(n, dtype=sd)
    out = torch.empty(n, dtype=od) if od is not None else None
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(gd)
        fn(p, g, m, v, step=step, weight_decay=0.01, adamw_mode=adamw, out_lowp=out, **HYPER)
    return p, m, v, out


@pytest.mark.parametrize(
    "gd,sd,od,adamw",
    [(torch.float32, torch.float32, None, True), (torch.bfloat16, torch.float32, torch.bfloat16, False)],
    ids=["fp32-adamw", "bf16grad-bf16out-l2"],
)
def test_100_steps_large_tails(gd, sd, od, adamw: bool) -> None:
    _native_or_fail()
    n = 1_000_003
    got = _run_steps(n, 100, gd, sd, od, adamw, tiered_ext.adam_step)
    want = _run_steps(n, 100, gd, sd, od, adamw, tiered_ext.adam_step_reference)
    torch.testing.assert_close(got[0], want[0], **P_TOL)
    torch.testing.assert_close(got[1], want[1], **P_TOL)
    if od is not None:
        # After 100 steps the masters differ by ulps, so their bf16 copies differ only where one sits
        # next to a rounding boundary.
        assert (got[3] != want[3]).float().mean().item() < 1e-3


def test_100_steps_match_torch_adamw() -> None:
    _native_or_fail()
    n = 100_003
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(100)]
    ours = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    theirs = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step, g in enumerate(grads, start=1):
        tiered_ext.adam_step(ours, g, m, v, step=step, weight_decay=0.01, **HYPER)
        theirs.grad = g
        opt.step()
    torch.testing.assert_close(ours, theirs.detach(), **P_TOL)
    torch.testing.assert_close(m, opt.state[theirs]["exp_avg"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v, opt.state[theirs]["exp_avg_sq"], rtol=1e-5, atol=1e-12)


def test_vector_paths_bitwise_equal_to_scalar() -> None:
    """Every vector path this CPU runs gives the scalar path's bits (AVX-512 is checked where present)."""
    _native_or_fail()
    mod = _loader.cpu_module()
    isas = list(mod.supported_isas())
    n = 4099
    previous = mod.get_isa()
    try:
        for gd, sd, od, adamw in itertools.product(GRAD_DTYPES, STATE_DTYPES, OUT_DTYPES, [True, False]):
            results = {}
            for name in isas:
                _loader.set_cpu_isa(name)
                results[name] = _run_steps(n, 3, gd, sd, od, adamw, tiered_ext.adam_step, seed=7)
            for name in isas:
                for a, b in zip(results[name], results["scalar"], strict=True):
                    assert a is None or torch.equal(a, b), (
                        f"{name} differs from scalar for {gd} {sd} {od} {adamw}"
                    )
            for name in isas:
                assert mod.self_test(name) == 0
    finally:
        _loader.set_cpu_isa(previous)


@pytest.mark.parametrize(
    "gd,sd,od", [(torch.float32, torch.float32, None), (torch.bfloat16, torch.bfloat16, torch.float16)]
)
def test_threads_bitwise_equal(gd, sd, od) -> None:
    _native_or_fail()
    n = 1_000_003
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_steps(n, 2, gd, sd, od, True, tiered_ext.adam_step, seed=3)
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        many = _run_steps(n, 2, gd, sd, od, True, tiered_ext.adam_step, seed=3)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, many, strict=True):
        assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("gd", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 70_000, 131_071], ids=["first", "second-block", "tail"])
def test_check_finite_modifies_nothing(isa: str, gd, bad: float, where: int) -> None:
    n = 131_072 + 3
    p, m, v, grads = _make(n, gd, torch.float32, seed=5)
    g = grads[0]
    g[where] = bad
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, out)]
    found = tiered_ext.adam_step(
        p, g, m, v, step=1, weight_decay=0.1, out_lowp=out, check_finite=True, **HYPER
    )
    assert found is True
    for a, b in zip((p, m, v, out), before, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # Without the check the step runs (and the bad element propagates, as in torch).
    assert tiered_ext.adam_step(p, g, m, v, step=1, weight_decay=0.1, **HYPER) is False
    assert not torch.equal(p, before[0])


def test_check_finite_sees_overflow_after_scaling(isa: str) -> None:
    n = 33
    p, m, v, grads = _make(n, torch.float16, torch.float32, seed=9)
    g = grads[0]
    g[5] = 60000.0
    kw = dict(step=1, weight_decay=0.0, check_finite=True, **HYPER)
    assert tiered_ext.adam_step(p.clone(), g, m.clone(), v.clone(), grad_scale=1e35, **kw) is True
    assert tiered_ext.adam_step(p, g, m, v, grad_scale=1.0, **kw) is False


@pytest.mark.parametrize("od", [torch.bfloat16, torch.float16], ids=str)
def test_lowp_copy_rounds_like_torch_on_all_bit_patterns(isa: str, od) -> None:
    """lr=0 leaves the master unchanged, so out_lowp must be exactly param.to(od) for any float:
    ties, subnormals, overflow to inf, infinities (every 2^20th bit pattern plus edge cases)."""
    bits = torch.arange(0, 2**32, 2**12 + 1, dtype=torch.int64)
    specials = torch.tensor(
        [0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF,
         0x7F800000, 0xFF800000, 0x477FF000, 0x477FEFFF, 0x387FC000, 0x33800000, 0x33000001, 0x33000000],
        dtype=torch.int64,
    )  # fmt: skip
    bits = torch.cat([bits, specials])
    p = (bits.to(torch.int64) & 0xFFFFFFFF).to(torch.int32).view(torch.float32).clone()
    p = p[~p.isnan()].contiguous()
    n = p.numel()
    out = torch.full((n,), float("nan"), dtype=od)
    g = torch.ones(n)
    m, v = torch.zeros(n), torch.zeros(n)
    want = p.to(od)
    tiered_ext.adam_step(
        p, g, m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, out_lowp=out
    )
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("od", [torch.bfloat16, torch.float16], ids=str)
def test_lowp_copy_of_nan_has_the_same_bits_on_every_path(od) -> None:
    """A NaN master's low-precision copy: the vector body and the scalar tail write the same bits
    (bf16: 0x7FC0 whatever the sign, as c10::BFloat16; fp16: sign and payload kept, quieted, as
    vcvtps2ph)."""
    _native_or_fail()
    payloads = [0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, 0x7FC02000, 0x7FA5A000]
    words = torch.tensor(payloads + [w | 0x80000000 for w in payloads], dtype=torch.int64)
    p0 = (words & 0xFFFFFFFF).to(torch.int32).view(torch.float32).repeat(3)  # vector body and tail
    mantissa = (words & 0x7FFFFF).repeat(3)
    sign = ((words >> 16) & 0x8000).repeat(3)
    if od == torch.float16:
        want = sign | 0x7E00 | (mantissa >> 13)
    else:
        want = torch.full_like(sign, 0x7FC0)
    mod = _loader.cpu_module()
    previous = mod.get_isa()
    try:
        for name in mod.supported_isas():
            _loader.set_cpu_isa(name)
            p, n = p0.clone(), p0.numel()
            out = torch.zeros(n, dtype=od)
            tiered_ext.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
                                 beta2=0.999, eps=1e-8, weight_decay=0.0, out_lowp=out)  # fmt: skip
            got = out.view(torch.int16).to(torch.int64) & 0xFFFF
            assert torch.equal(got, want), f"{name}: {[hex(x) for x in got.tolist()]}"
    finally:
        _loader.set_cpu_isa(previous)


def test_zero_elements_and_kernel_info() -> None:
    _native_or_fail()
    e = torch.empty(0)
    assert (
        tiered_ext.adam_step(e, e.clone(), e.clone(), e.clone(), step=1, weight_decay=0.0, **HYPER) is False
    )
    info = tiered_ext.kernel_info()
    assert info["cpu_adam"] in {"native-avx2", "native-avx512", "native-scalar"}
    assert isinstance(info["threads"], int) and info["threads"] >= 1
    assert "scalar" in info["cpu_isas"]


def _ok(n: int = 8):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


BAD = [
    ("grad size", lambda t: t.update(grad=torch.zeros(9)), {}, "grad has 9 elements"),
    ("exp_avg size", lambda t: t.update(exp_avg=torch.zeros(7)), {}, "exp_avg has 7 elements"),
    (
        "param dtype",
        lambda t: t.update(param=torch.zeros(8, dtype=torch.float64)),
        {},
        "param must be float32",
    ),
    ("grad dtype", lambda t: t.update(grad=torch.zeros(8, dtype=torch.int32)), {}, "grad must be float32"),
    ("state dtype", lambda t: t.update(exp_avg=torch.zeros(8, dtype=torch.float16)), {}, "exp_avg must be"),
    ("state mismatch", lambda t: t.update(exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16)), {}, "exp_avg_sq"),
    ("non-contiguous", lambda t: t.update(grad=torch.zeros(16)[::2]), {}, "grad must be a 1-D contiguous"),
    ("2-D", lambda t: t.update(exp_avg_sq=torch.zeros(2, 4)), {}, "exp_avg_sq must be a 1-D"),
    ("device", lambda t: t.update(grad=torch.zeros(8, device="meta")), {}, "grad is on meta"),
    ("aliasing", lambda t: t.update(exp_avg=t["param"]), {}, "param and exp_avg share memory"),
    ("out dtype", lambda t: None, {"out_lowp": torch.zeros(8)}, "out_lowp must be bfloat16 or float16"),
    (
        "out size",
        lambda t: None,
        {"out_lowp": torch.zeros(3, dtype=torch.bfloat16)},
        "out_lowp has 3 elements",
    ),
    ("lr", lambda t: None, {"lr": -1.0}, "lr must be"),
    ("beta1", lambda t: None, {"beta1": 1.0}, "beta1 must be in"),
    ("beta2", lambda t: None, {"beta2": -0.1}, "beta2 must be in"),
    ("eps", lambda t: None, {"eps": 0.0}, "eps must be"),
    ("step", lambda t: None, {"step": 0}, "step must be"),
    ("weight_decay", lambda t: None, {"weight_decay": float("nan")}, "weight_decay must be"),
    ("grad_scale", lambda t: None, {"grad_scale": float("inf")}, "grad_scale must be finite"),
]


@pytest.mark.parametrize(
    "fn", [tiered_ext.adam_step, tiered_ext.adam_step_reference], ids=["native", "reference"]
)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_a_clear_value_error(fn, case) -> None:
    _, mutate, extra, message = case
    tensors = _ok()
    mutate(tensors)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    kw.update(extra)
    before = tensors["param"].clone()
    with pytest.raises(ValueError, match=message):
        fn(tensors["param"], tensors["grad"], tensors["exp_avg"], tensors["exp_avg_sq"], **kw)
    assert torch.equal(tensors["param"], before)


@pytest.mark.parametrize(
    "fn",
    [tiered_ext.adam_step, tiered_ext.adam_step_reference, tiered_ext.gpu_adam_step],
    ids=["native", "reference", "multi-tensor"],
)
@pytest.mark.parametrize(
    ("change", "message"),
    [({"betas": (0.9, 0.999)}, "unexpected keyword argument 'betas'"), ({"lr": None}, "missing .*'lr'")],
    ids=["unknown", "missing"],
)
def test_a_misspelt_or_missing_hyper_parameter_is_refused_by_name(fn, change, message) -> None:
    """The entries take their Adam scalars as one keyword bundle (`tiered_ext.AdamScalars`): a
    keyword the bundle does not declare, or a required one left out, is still Python's TypeError
    naming it, never swallowed by ``**hyper`` nor defaulted."""
    t = _ok()
    kw: dict[str, object] = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    kw = {k: v for k, v in {**kw, **change}.items() if v is not None}
    args = (t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"])
    if fn is tiered_ext.gpu_adam_step:
        args = tuple([a] for a in args)
    with pytest.raises(TypeError, match=message):
        fn(*args, **kw)
    assert not t["param"].any() and not t["exp_avg"].any()


@pytest.mark.parametrize(
    "case",
    [
        ("size", dict(grad=torch.zeros(9)), {}, "grad has 9 elements"),
        ("contiguous", dict(grad=torch.zeros(16)[::2]), {}, "contiguous"),
        (
            "dtype",
            dict(exp_avg=torch.zeros(8, dtype=torch.float16)),
            {},
            "exp_avg must be float32 or bfloat16",
        ),
        ("alias", "alias", {}, "share memory"),
        ("out", {}, {"out_lowp": torch.zeros(8)}, "out_lowp has unsupported dtype"),
        ("eps", {}, {"eps": -1.0}, "eps must be > 0"),
        ("beta", {}, {"beta2": 1.5}, "beta2 must be in"),
    ],
    ids=lambda c: c[0],
)
def test_cpp_binding_checks_again(case) -> None:
    """The C++ layer refuses bad input on its own (TORCH_CHECK), for callers that bypass Python."""
    _native_or_fail()
    _, tensors, extra, message = case
    t = _ok()
    if tensors == "alias":
        t["exp_avg_sq"] = t["exp_avg"]
    else:
        t.update(tensors)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
              grad_scale=1.0, out_lowp=None, check_finite=False)  # fmt: skip
    kw.update(extra)
    with pytest.raises(ValueError, match=message):
        _loader.cpu_module().adam_step(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], **kw)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize(
    "gd,sd,od",
    list(itertools.product(GRAD_DTYPES, STATE_DTYPES, OUT_DTYPES)),
    ids=lambda x: str(x).replace("torch.", "") if x is not None else "noout",
)
def test_without_weight_decay_matches_reference(gd, sd, od, adamw: bool) -> None:
    _native_or_fail()
    n = 1037
    got = _run_steps_wd(n, 5, gd, sd, od, adamw, tiered_ext.adam_step)
    want = _run_steps_wd(n, 5, gd, sd, od, adamw, tiered_ext.adam_step_reference)
    torch.testing.assert_close(got[0], want[0], **ref_tol(sd))
    torch.testing.assert_close(got[1].float(), want[1].float(), **ref_tol(sd))


def _run_steps_wd(n: int, steps: int, gd, sd, od, adamw: bool, fn):
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n, dtype=sd), torch.zeros(n, dtype=sd)
    out = torch.empty(n, dtype=od) if od is not None else None
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(gd)
        fn(p, g, m, v, step=step, weight_decay=0.0, adamw_mode=adamw, out_lowp=out, **HYPER)
    return p, m, v, out


MANY_SIZES = [0, 1, 17, 65_535, 65_536, 65_537, 3 * 65_536 + 5, 1037]


@pytest.mark.parametrize("threads", [1, 2])
def test_many_partitions_in_one_call_equal_one_call_each(threads: int) -> None:
    """_adam_step_many (one parallel region over the blocks of every partition, each partition with
    its own step count and dtypes) gives the bits of adam_step called once per partition."""
    _native_or_fail()
    combos = list(itertools.product(GRAD_DTYPES, STATE_DTYPES))
    parts = []
    for i, n in enumerate(MANY_SIZES):
        gd, sd = combos[i % len(combos)]
        p, m, v, grads = _make(n, gd, sd, seed=100 + i)
        g = grads[0]
        parts.append((p, g, m, v, torch.full((n,), float("nan"), dtype=torch.bfloat16)))
    mine = [tuple(t.clone() for t in part) for part in parts]
    steps = [1 + (i % 4) for i in range(len(parts))]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True, grad_scale=0.5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tiered_ext._adam_step_many([t[0] for t in mine], [t[1] for t in mine], [t[2] for t in mine],
                                   [t[3] for t in mine], steps=steps, out_lowp=[t[4] for t in mine], **kw)  # fmt: skip
    finally:
        torch.set_num_threads(previous)
    for i, (part, step) in enumerate(zip(parts, steps, strict=True)):
        p, g, m, v, out = part
        tiered_ext.adam_step(p, g, m, v, step=step, out_lowp=out, **kw)
        for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq", "out"), mine[i], part, strict=True):
            assert torch.equal(a, b), f"partition {i} (n={MANY_SIZES[i]}): {name} differs"


def test_many_partitions_refused_before_any_is_touched() -> None:
    _native_or_fail()
    ps = [torch.randn(70_000), torch.randn(5), torch.randn(9)]
    gs = [torch.randn(70_000), torch.randn(5), torch.randn(8)]  # [2] has the wrong size
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    before = [p.clone() for p in ps]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    with pytest.raises(ValueError, match=r"\[2\]: .*grad has 8 elements, param has 9"):
        tiered_ext._adam_step_many(ps, gs, ms, vs, steps=[1, 1, 1], **kw)
    assert all(torch.equal(p, b) for p, b in zip(ps, before, strict=True))
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] share memory"):  # stepped twice
        tiered_ext._adam_step_many([ps[0], ps[0]], [gs[0], gs[0]], [ms[0], torch.zeros(70_000)],
                                   [vs[0], torch.zeros(70_000)], steps=[1, 1], **kw)  # fmt: skip
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] and exp_avgs\[1\] share memory"):
        tiered_ext._adam_step_many([ps[0], torch.zeros(70_000)], [gs[0], gs[0]], [ms[0], ms[0]],
                                   [vs[0], torch.zeros(70_000)], steps=[1, 1], **kw)  # fmt: skip
    assert torch.equal(ps[0], before[0]) and not ms[0].any()
    with pytest.raises(ValueError, match=r"\[1\]: .*step must be >= 1"):
        tiered_ext._adam_step_many(ps[:2], gs[:2], ms[:2], vs[:2], steps=[1, 0], **kw)
    assert all(torch.equal(p, b) for p, b in zip(ps, before, strict=True))
