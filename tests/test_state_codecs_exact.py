"""The optimizer-state codecs' fast paths ([Note: codec speed]) are the first codecs bit for bit
(tests/state_codecs_reference.py), and their decode no longer depends on torch's thread count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from state_codecs_reference import BlockLog, bf16_encode

from tiered.optim.state_codecs import CHUNK
from tiered.optim.state_format import FORMATS

REFERENCE = {
    ("bf16", "exp_avg"): None,
    ("bf16", "exp_avg_sq"): None,
    ("int8", "exp_avg"): BlockLog(signed=True, steps=8),
    ("int8", "exp_avg_sq"): BlockLog(signed=False, steps=16, sqrt_domain=True),
}


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


@pytest.mark.parametrize(("fmt", "kind"), list(REFERENCE))
def test_the_fast_codecs_are_the_reference_bit_for_bit(fmt: str, kind: str) -> None:
    codec = getattr(FORMATS[fmt], kind)
    ref = REFERENCE[(fmt, kind)]
    for what, x in _inputs():
        n = x.numel()
        got, want = (torch.empty(codec.encoded_bytes(n), dtype=torch.uint8) for _ in range(2))
        codec.encode(x, got, torch.Generator().manual_seed(7))
        (bf16_encode if ref is None else ref.encode)(x, want, torch.Generator().manual_seed(7))
        assert torch.equal(got, want), f"{fmt} {kind} encode of {what}"
        if ref is not None:
            a, b = torch.empty(n), torch.empty(n)
            codec.decode(want, a)
            ref.decode(want, b)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{fmt} {kind} decode of {what}"


@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_int8_decode_is_the_same_on_any_thread_count(kind: str) -> None:
    """Per element exp2 gives a tensor's last elements per thread the scalar libm value, which
    differs in the last bit for some codes: 3 threads over 385 blocks put such tails mid-tile."""
    codec = getattr(FORMATS["int8"], kind)
    n = 385 * 256
    buf = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8)
    codec.encode(torch.rand(n), buf, torch.Generator().manual_seed(0))
    levels = torch.arange(1, codec.levels + 1, dtype=torch.int16)
    scalar = torch.stack(
        [torch.exp2((levels[i : i + 1].float() - codec.levels) / codec.steps)[0] for i in range(len(levels))]
    )
    vector = torch.exp2((levels.repeat_interleave(64).float() - codec.levels) / codec.steps)[::64]
    odd = (scalar != vector).nonzero()
    if not len(odd):
        pytest.skip("this CPU's vector and scalar exp2 agree on every level: nothing to tell apart")
    buf[4 * 385 :] = int(odd[0]) + 1  # every element that code
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            out = torch.empty(n)
            codec.decode(buf, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
