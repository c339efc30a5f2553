"""The optimizer-state codecs' bits: decode is the first codecs' bit for bit
(tests/state_codecs_reference.py: existing checkpoints decode to the same fp32), the native kernels
are the torch codecs bit for bit on encode and decode ([Note: counter-based rounding noise]), and
neither depends on torch's thread count, the vector path or where a tensor is cut.

The first codecs drew their rounding noise from a torch.Generator; the noise is now a hash of a
key and the element's index, so their encodings are no longer an oracle for encode (decode, which
has no noise, still is): encode is checked against the torch codecs instead, and its rounding by
the unbiasedness and error-bound tests of tests/test_state_format.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from state_codecs_reference import BlockLog

import tiered_ext
from tiered.optim.rounding_noise import RoundingNoise, native_module, noise_key
from tiered.optim.state_codecs import BLOCK, CHUNK, MomentCodec
from tiered.optim.state_format import FORMATS, rounding_noise

REFERENCE = {
    ("int8", "exp_avg"): BlockLog(signed=True, steps=8),
    ("int8", "exp_avg_sq"): BlockLog(signed=False, steps=16, sqrt_domain=True),
}
CODECS = [("bf16", "exp_avg"), ("bf16", "exp_avg_sq"), *REFERENCE]
NOISES = [
    RoundingNoise(),
    RoundingNoise(noise_key(7, 1), 12345),
    RoundingNoise(noise_key(3), (1 << 32) - 700),
]
"""Default; a key at an offset; a run of indices across 2**32 (the segment key changes mid-tensor)."""


def _inputs() -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 255, 256, 257, 1000, 65536 + 300, 2 * CHUNK + 300):  # CHUNK: several passes
        m = torch.randn(n, generator=g) * 1e-3
        yield f"{n} exp_avg-like", m
        yield f"{n} exp_avg_sq-like", m * m + torch.rand(n, generator=g) * 1e-9
        if n > CHUNK:
            continue  # the passes' seams: the two kinds above are enough
        exps = torch.randint(-140, 120, (n,), generator=g).float()
        yield f"{n} wide range", torch.randn(n, generator=g) * torch.exp2(exps)
        z = m.clone()
        z[::3] = 0.0
        z[::5] = -0.0
        yield f"{n} zeros", z
        yield f"{n} all zero", torch.zeros(n)
        if n >= 300:
            b = m.clone()
            b[3], b[260], b[299] = float("nan"), float("inf"), -float("inf")
            yield f"{n} non-finite", b
            s = m.clone()
            s[:256] = torch.randn(256, generator=g) * 1e-40
            yield f"{n} subnormal block", s
            h = m.clone()
            h[0], h[5] = 3.4e38, -3.39e38
            yield f"{n} near fp32's max", h


def _codec(fmt: str, kind: str) -> MomentCodec:
    codec: MomentCodec = getattr(FORMATS[fmt], kind)
    return codec


def _encoded(codec: MomentCodec, x: torch.Tensor, noise: RoundingNoise, native: bool) -> torch.Tensor:
    buf = torch.empty(codec.encoded_bytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, buf, noise, native=native)
    return buf


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each vector path of the native kernels this CPU runs (the codecs share the Adam's choice)."""
    mod = native_module()
    assert mod is not None, f"the native module must build here: {tiered_ext.kernel_info()['cpu_adam']}"
    if request.param not in mod.supported_isas():
        pytest.skip(f"this CPU does not run {request.param}")
    previous = str(mod.get_isa())
    mod.set_isa(request.param)
    yield request.param
    mod.set_isa(previous)


@pytest.mark.parametrize(("fmt", "kind"), list(REFERENCE))
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_decode_is_the_first_codecs_bit_for_bit(fmt: str, kind: str, native: bool) -> None:
    """Codes written by the first encoder (generator noise, an old checkpoint's) decode as the
    first decoder decoded them, NaN blocks' signs included, on both implementations."""
    codec, ref = _codec(fmt, kind), REFERENCE[(fmt, kind)]
    for what, x in _inputs():
        n = x.numel()
        old = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8)
        ref.encode(x, old, torch.Generator().manual_seed(7))
        got, want = torch.empty(n), torch.empty(n)
        codec.decode(old, got, native=native)
        ref.decode(old, want)
        assert torch.equal(_bits(got), _bits(want)), f"{fmt} {kind} decode of {what}"


@pytest.mark.parametrize(("fmt", "kind"), CODECS)
def test_native_encode_and_decode_are_the_torch_codecs_bit_for_bit(fmt: str, kind: str, isa: str) -> None:
    codec = _codec(fmt, kind)
    for what, x in _inputs():
        if x.numel() > CHUNK and isa != "scalar":
            continue  # the torch codec's pass seams: once (every CPU runs scalar), the slow part here
        for noise in NOISES if x.numel() <= CHUNK else NOISES[-1:]:
            native, torch_ = _encoded(codec, x, noise, True), _encoded(codec, x, noise, False)
            assert torch.equal(native, torch_), f"{isa} {fmt} {kind} encode of {what} with {noise}"
            a, b = torch.empty(x.numel()), torch.empty(x.numel())
            codec.decode(native, a, native=True)
            codec.decode(native, b, native=False)
            assert torch.equal(_bits(a), _bits(b)), f"{isa} {fmt} {kind} decode of {what}"


@pytest.mark.parametrize(("fmt", "kind"), CODECS)
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_encode_is_the_same_on_any_thread_count_and_tile_cut(fmt: str, kind: str, native: bool) -> None:
    """An element's bits depend on its value, its block and its global index only: encoding on 1
    or 3 threads, or in two tiles (the second with the noise moved on by the first's length),
    gives the same bytes."""
    codec = _codec(fmt, kind)
    g = torch.Generator().manual_seed(1)
    n, cut = 385 * BLOCK + 77, 131 * BLOCK  # 3 threads put their seams mid-block
    x = torch.randn(n, generator=g) * 1e-3
    x = x * x if kind == "exp_avg_sq" else x
    noise = rounding_noise(9, 2, kind, 4096)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 3):
            torch.set_num_threads(t)
            outs.append(_encoded(codec, x, noise, native))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    whole = outs[0]
    for a, b in ((0, cut), (cut, n)):
        part = _encoded(codec, x[a:b].contiguous(), noise.at(a), native)
        want = torch.cat([whole[o : o + k] for o, k in codec.piece_bytes(n, a, b)])
        assert torch.equal(part, want), f"elements [{a}, {b})"


def test_steps_and_moments_get_unrelated_noise() -> None:
    """The words of different steps, moments, groups and offsets differ (a shared stream would
    round them alike): about half the bf16 roundings of a value halfway between two bf16s differ."""
    codec = FORMATS["bf16"].exp_avg
    x = torch.full((1 << 14,), 1.0 + 2.0**-8)  # exactly halfway: rounds up with probability 1/2
    base = _encoded(codec, x, rounding_noise(5, 0, "exp_avg", 0), native=False)
    for other in (
        rounding_noise(6, 0, "exp_avg", 0),
        rounding_noise(5, 0, "exp_avg_sq", 0),
        rounding_noise(5, 1, "exp_avg", 0),
        rounding_noise(5, 0, "exp_avg", 1),
    ):
        differ = float((_encoded(codec, x, other, native=False) != base).view(-1, 2).any(1).float().mean())
        assert 0.45 < differ < 0.55, (other, differ)  # binomial(16384, 1/2): sigma 0.004


def test_int8_lower_code_is_defined_by_the_levels() -> None:
    """A value exactly on a level decodes to itself (it never rounds up), and a value an ulp off a
    level decodes to one of its two neighbouring levels, on both implementations: the code comes
    from comparing with the levels (grid x the block's maximum), not from a log2 that can be an
    ulp off."""
    codec = FORMATS["int8"].exp_avg
    assert isinstance(codec, type(FORMATS["int8"].exp_avg_sq))
    top = torch.tensor(0.0123)
    level = codec.grid * top  # code c's level in a block whose maximum is top (code 0: 0)
    on = level[1:].clone()  # 127 values, the last top itself
    below = torch.nextafter(on, torch.zeros(()))
    above = torch.nextafter(on, torch.ones(())).clamp(max=top)
    for native in (False, True):
        for vals in (on, below, above):
            y = torch.cat([vals, top.view(1)])  # the block's maximum stays top
            buf = _encoded(codec, y, RoundingNoise(noise_key(len(y))), native)
            out = torch.empty(y.numel())
            codec.decode(buf, out, native=native)
            lo = torch.searchsorted(level, y, right=True) - 1  # the largest level <= y
            hi = (lo + 1).clamp(max=codec.levels)
            ok = (out == level[lo]) | ((out == level[hi]) & (y != level[lo]))
            assert bool(ok.all()), (native, int((~ok).sum()))
