"""Codecs for one Adam moment: fp32 bytes, bf16 with stochastic rounding, 8-bit block-wise log codes.

Each codec turns a flat fp32 tensor into a flat uint8 buffer of `encoded_bytes(numel)` bytes and
back, and states the error of that round trip (`error_bound`) as [Note: compressed optimizer
state] in tiered/optim/state_format.py documents it. Every lossy codec rounds stochastically:
Adam's moments move by a small fraction of themselves per step ((1 - beta2) = 0.1% for
exp_avg_sq), less than half a step of any 8- or 16-bit code, so round-to-nearest would freeze them
(an exp_avg_sq that can only grow); rounding up with the probability of the remainder keeps each
stored value unbiased (E[decode(encode(x))] = x) and lets the moments drift as they should.

[Note: codec speed]
The codecs run once per tile per step on the CPU, on every element of both moments, so they are
written as few vectorised torch ops with few temporaries, and decode to the same bits as the
first, plainer versions (tests/state_codecs_reference.py, the decode tests' oracle): no `torch.where` (not
vectorised here: 2 ms per 1M elements, as much as ten arithmetic ops), no `clamp_min` (slow the
same way; `clamp(0, inf)` gives the same values), and the 8-bit codes' levels are a table of
2**((c - levels) / steps) looked up per code instead of an exp2 per element. The table holds
what the vectorised exp2 computes; the per-element exp2 gave each thread's last few elements
the scalar libm value instead, which differs in the last bit for 16 of the levels, so the old
decode depended on torch's thread count (tiles cut where a thread's range ends) and the table's
does not. Decode is that table look-up times the block's scale; the native decode
(tiered_ext, below) is the same product per element, bit for bit.
A tile is coded in passes of `CHUNK` elements (whole blocks, 1 MiB of fp32), so the dozen
temporaries of a pass stay in the CPU's cache instead of streaming a tile's worth of memory
each (int8 encode of a 4M-element tile: 18 -> 8 ms per 1M elements here). The 8-bit codes are
int32 while they are computed (the table's index type: no conversion per look-up). Even so the
torch ops cost 8 ms (int8) and 2.5 ms (bf16) per 1M elements to encode, ~35 s of CPU per step
of a 2B-parameter model; the native kernels (tiered_ext/csrc/cpu_adam/state_codecs_kernel.h,
built with the CPU Adam, same ISA dispatch and threads) do the same work in one pass per block,
and these torch codecs are their fallback and their tests' oracle: the same bits, tested.

The rounding noise and the 8-bit lower code are defined in [Note: counter-based rounding
noise] (tiered/optim/rounding_noise.py).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator

import torch

from tiered.optim.rounding_noise import RoundingNoise, noise_words, use_native

BLOCK = 256
CHUNK = 1024 * BLOCK
"""Elements per pass of a codec over a tile: its temporaries stay in cache ([Note: codec speed])."""
"""Elements per block of the 8-bit codes: one fp32 scale (the block's absolute maximum) each,
1/64 B per element on top of the byte (as bitsandbytes' block-wise 8-bit optimizers)."""
_FP32_SLACK = 1e-6
_BF16_SAFE = 3.38e38
"""Below this magnitude stochastic rounding to bf16 cannot reach inf (bf16's largest is 3.39e38)."""
"""Relative slack for the fp32 arithmetic of encode and decode (log2, exp2, the scale)."""


def _i64(v: int) -> int:
    """The int64 whose bits are the 64-bit `v` (the native kernels take keys as int64)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _flat_f32(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"{what}: expected a flat contiguous float32 tensor, got {x.dtype} {tuple(x.shape)}")
    return x


def _passes(numel: int) -> Iterator[tuple[int, int]]:
    """[start, stop) of each pass of `CHUNK` elements over a tile ([Note: codec speed])."""
    for a in range(0, numel, CHUNK):
        yield a, min(numel, a + CHUNK)


def _grid(levels: int, steps: int) -> torch.Tensor:
    """2**((c - levels) / steps) for the codes c = 1..levels (code 0: 0.0), in fp32, computed by the
    same fp32 ops the codes were defined with, each in the body of one vectorised kernel call
    (the values of a tensor's last few elements can come from the scalar libm function instead,
    which differs in the last bit for some codes; [Note: codec speed])."""
    reps = 64  # 256 x 64 elements: one thread, no tail, and every code well inside the vector body
    c = torch.arange(levels + 1, dtype=torch.int16).repeat_interleave(reps)
    grid = torch.exp2((c.float() - levels) / steps)[reps // 2 :: reps].contiguous()
    grid[0] = 0.0
    return grid


class MomentCodec(abc.ABC):
    """Encodes one moment tensor into bytes and back; see the module docstring."""

    name: str
    lossless: bool = False
    """decode(encode(x)) == x bit for bit."""
    block_numel: int = 1
    """Elements encoded together: elements [start, stop) of an encoding, start a multiple of it,
    decode on their own from the bytes `piece_bytes` names (a checkpoint load decodes a tile
    chunk by chunk, [Note: compressed optimizer state])."""

    element: torch.dtype | None = None
    """The dtype a fixed-width codec stores each element as (its encoding is those elements'
    bytes, addressed by element in a checkpoint); None for a layout of its own (blocks)."""

    def encoded_bytes(self, numel: int) -> int:
        """Bytes of the encoding of `numel` elements."""
        if self.element is None:
            raise NotImplementedError(f"{type(self).__name__} has no fixed element: define encoded_bytes")
        return numel * self.element.itemsize

    def storage(self, numel: int) -> tuple[int, torch.dtype]:
        """(numel, dtype) of the partition holding the encoding of `numel` elements: the codec's
        own element type where it has one (so a checkpoint addresses it by element), else bytes."""
        if self.element is not None:
            return numel, self.element
        return self.encoded_bytes(numel), torch.uint8

    def decoded_numel(self, nbytes: int) -> int:
        """The element count whose encoding is `nbytes` bytes (ValueError where none is)."""
        per = self.encoded_bytes(1)
        if nbytes % per:
            raise ValueError(f"{self.name}: {nbytes} bytes are not an encoding ({per} bytes per element)")
        return nbytes // per

    def piece_bytes(self, numel: int, start: int, stop: int) -> list[tuple[int, int]]:
        """(offset, length) of the byte ranges of an encoding of `numel` elements that, joined,
        are the encoding of its elements [start, stop) (start a multiple of `block_numel`)."""
        per = self.encoded_bytes(1)
        return [(per * start, per * (stop - start))]

    # encode and decode check their arguments and default the noise here, once for every codec;
    # each codec writes only its coding, `_encode_checked` / `_decode_checked`.
    def encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        noise: RoundingNoise | None = None,
        *,
        native: bool | None = None,
    ) -> None:
        """Write the encoding of flat fp32 `x` into flat uint8 `out` (`encoded_bytes(x.numel())`),
        rounding with `noise` (default RoundingNoise(): key 0, offset 0). `native`: None, the
        native kernel when it is built, else the torch ops; False, the torch ops; True, the
        native kernel (RuntimeError when it is not built). Both give the same bits."""
        self._check(x, out, "encode")
        self._encode_checked(x, out, noise if noise is not None else RoundingNoise(), native)

    def decode(self, buf: torch.Tensor, out: torch.Tensor, *, native: bool | None = None) -> None:
        """Write the values `buf` encodes into flat fp32 `out` (deterministic: no randomness);
        `native` as for encode."""
        self._check(out, buf, "decode")
        self._decode_checked(buf, out, native)

    def _encode_checked(
        self, x: torch.Tensor, out: torch.Tensor, noise: RoundingNoise, native: bool | None
    ) -> None:
        """`encode` on checked arguments; by default the elements cast to `element` (exact for fp32)."""
        assert self.element is not None, f"{type(self).__name__} must define _encode_checked"
        out.view(self.element).copy_(x)

    def _decode_checked(self, buf: torch.Tensor, out: torch.Tensor, native: bool | None) -> None:
        """`decode` on checked arguments; by default the stored elements widened to fp32 (a
        shift per element for bf16: torch's copy is as fast as a kernel)."""
        assert self.element is not None, f"{type(self).__name__} must define _decode_checked"
        out.copy_(buf.view(self.element))

    @abc.abstractmethod
    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per element, a bound on |decode(encode(x)) - x| that every encoding of `x` meets."""

    def _check(self, x: torch.Tensor, buf: torch.Tensor, what: str) -> None:
        _flat_f32(x, f"{self.name} {what}")
        want = self.encoded_bytes(x.numel())
        if buf.dtype != torch.uint8 or buf.numel() != want or not buf.is_contiguous():
            raise ValueError(
                f"{self.name} {what}: the encoded buffer must be {want} contiguous uint8 bytes for "
                f"{x.numel()} elements, got {buf.numel()} of {buf.dtype}"
            )


class Fp32Codec(MomentCodec):
    """The fp32 bytes themselves: exact."""

    name = "fp32"
    lossless = True
    element = torch.float32

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


class Bf16StochasticCodec(MomentCodec):
    """bfloat16 (8 significant bits, fp32's exponent range), rounded stochastically: the 16 low
    bits of the fp32 pattern plus a uniform 16-bit integer, carried into the kept half. The sign is
    untouched, so a non-negative moment stays non-negative and 0 stays 0; non-finite values are
    rounded to nearest (an inf stays inf, a NaN a NaN)."""

    name = "bf16"
    element = torch.bfloat16

    def _encode_checked(
        self, x: torch.Tensor, out: torch.Tensor, noise: RoundingNoise, native: bool | None
    ) -> None:
        dst = out.view(torch.int16)
        if x.numel() == 0:
            return
        mod = use_native(native)
        if mod is not None:
            odd = bool(mod.bf16_encode(x, dst, _i64(noise.key), noise.offset))
        else:
            for a, b in _passes(x.numel()):  # [Note: codec speed]
                self._encode(x[a:b], dst[a:b], noise.at(a))
            odd = not float(x.abs().amax()) <= _BF16_SAFE  # one reduction; NaN fails it too
        if odd:
            # non-finite values, and the largest finite ones (rounding up may reach inf): nearest
            bad = ~torch.isfinite(x) | (x.abs() > _BF16_SAFE)
            dst.view(torch.bfloat16)[bad] = x[bad].to(torch.bfloat16)

    @staticmethod
    def _encode(x: torch.Tensor, dst: torch.Tensor, noise: RoundingNoise) -> None:
        # the word's high 16 bits, carried into the kept half ([Note: counter-based rounding noise])
        words = noise_words(noise, x.numel()).bitwise_right_shift_(16).bitwise_and_(0xFFFF)
        words.add_(x.view(torch.int32)).bitwise_right_shift_(16)
        dst.copy_(words)  # int32 -> int16 keeps the low half

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        # below one ulp: 2^(floor(log2|x|) - 7) <= 2^-7 |x|; fp32 subnormals keep a fixed ulp
        return torch.clamp(x.abs() * 2.0**-7, min=2.0**-133)


class BlockLogCodec(MomentCodec):
    """8-bit codes on a logarithmic grid below each block's absolute maximum.

    A block of `BLOCK` elements stores its maximum magnitude ``top`` as fp32 and each element as a
    code c: 0 is zero, c >= 1 is ``top * 2**((c - levels) / steps_per_octave)``, so the grid has a
    constant relative step ``r = 2**(1/steps_per_octave)`` from ``top`` down to the smallest level
    ``low = top * 2**((1 - levels) / steps_per_octave)``. An element between two levels is rounded to
    the upper one with the probability that keeps its expectation (below ``low``: between 0 and
    ``low``). Signed codes keep the sign in the top bit (127 levels); unsigned ones use 255 levels.
    With ``sqrt_domain`` the codec stores sqrt(x) (x >= 0; a negative input, which Adam's
    exp_avg_sq never is, encodes as 0) and decodes its square: never negative, zero exact, and
    relative precision kept for the small values the update divides by.

    Bytes: the block scales (fp32, first, so they stay aligned) then one code per element.
    """

    def __init__(self, name: str, *, signed: bool, steps_per_octave: int, sqrt_domain: bool = False) -> None:
        self.name = name
        self.signed = signed
        self.levels = 127 if signed else 255
        self.steps = steps_per_octave
        self.sqrt_domain = sqrt_domain
        self.step_ratio = 2.0 ** (1.0 / steps_per_octave)
        self.low_fraction = 2.0 ** ((1 - self.levels) / steps_per_octave)
        """The smallest non-zero level, as a fraction of the block's maximum."""
        self.grid = _grid(self.levels, steps_per_octave)
        """Level of each code 0..levels as a fraction of the block's maximum, code 0 zero."""
        self.signed_grid = torch.cat([self.grid, -self.grid])[:256] if signed else self.grid
        """The same by signed code (the sign bit 128 set: negated; 128 itself is -0.0)."""

    block_numel = BLOCK

    def encoded_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / BLOCK) + numel

    def decoded_numel(self, nbytes: int) -> int:
        # n = 256k + r (0 < r <= 256) takes 260k + r + 4 bytes: ceil(bytes / 260) is its block count
        n = nbytes - 4 * math.ceil(nbytes / (BLOCK + 4))
        if n < 0 or self.encoded_bytes(n) != nbytes:
            raise ValueError(f"{self.name}: {nbytes} bytes are not an encoding of whole {BLOCK}-blocks")
        return n

    def piece_bytes(self, numel: int, start: int, stop: int) -> list[tuple[int, int]]:
        if start % BLOCK or not 0 <= start <= stop <= numel:
            raise ValueError(f"{self.name}: elements [{start}, {stop}) of {numel} do not start on a block")
        first, last = start // BLOCK, math.ceil(stop / BLOCK)
        return [(4 * first, 4 * (last - first)), (4 * math.ceil(numel / BLOCK) + start, stop - start)]

    def _split(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb = math.ceil(numel / BLOCK)
        return buf[: 4 * nb].view(torch.float32), buf[4 * nb :]

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        # clamp(0, inf), not clamp_min(0): the same values, a vectorised kernel ([Note: codec speed])
        # sqrt in float64, rounded to fp32: the correctly rounded sqrt the kernels compute; torch's
        # vectorised fp32 sqrt is not always (1 ulp off seen here; [Note: counter-based rounding noise])
        y = x.clamp(0.0, math.inf).double().sqrt_().float() if self.sqrt_domain else x
        nb = math.ceil(x.numel() / BLOCK)
        if nb * BLOCK != x.numel():
            y = torch.nn.functional.pad(y, (0, nb * BLOCK - x.numel()))
        return y.view(nb, BLOCK)

    def _encode_checked(
        self, x: torch.Tensor, out: torch.Tensor, noise: RoundingNoise, native: bool | None
    ) -> None:
        n = x.numel()
        scales, codes = self._split(out, n)
        mod = use_native(native)
        if mod is not None:
            mod.log_encode(x, scales, codes, self.grid, self.levels, self.steps, self.signed, self.sqrt_domain,
                           _i64(noise.key), noise.offset)  # fmt: skip
            return
        for a, b in _passes(n):  # [Note: codec speed]
            self._encode(x[a:b], scales[a // BLOCK : math.ceil(b / BLOCK)], codes[a:b], noise.at(a))

    def _encode(
        self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, noise: RoundingNoise
    ) -> None:
        y = self._blocks(x)
        mag = y.abs()
        top = mag.amax(dim=1, keepdim=True)
        # a block holding inf or NaN decodes as NaN throughout: visible, as in the exact state
        finite = torch.isfinite(top)
        scales.copy_(torch.where(finite, top, math.nan).view(-1))
        top = torch.where(finite, top, 0.0)  # such a block's codes are its signs only (below)
        lo_code = self._lower_code(mag, top)
        hi_code = torch.add(lo_code, 1).clamp_(max=self.levels)
        lo = self._grid(lo_code).mul_(top)  # grid[0] = 0: top * 0.0, as a zero code decodes
        width = self._grid(hi_code).mul_(top).sub_(lo)
        up = mag.sub_(lo).div_(width)  # where width > 0; else not used (below)
        words = noise_words(noise, y.numel()).view(y.shape)
        u = words.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).float().mul_(2.0**-24)
        code = lo_code.add_(torch.lt(u, up).logical_and_(width > 0))  # up one level with probability up
        code.mul_(finite)
        if self.signed:
            code.add_(torch.lt(y, 0), alpha=128)  # the sign bit over codes 0..127
        codes.copy_(code.view(-1)[: x.numel()])  # int32 -> uint8 keeps the low byte

    def _lower_code(self, mag: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """The largest code c with grid[c] * top <= mag (0 where mag is 0), as int32: estimated by
        log2, then corrected by comparing with the levels ([Note: counter-based rounding noise])."""
        safe = torch.where(top > 0, top, 1.0)
        pos = torch.div(mag, safe).log2_().mul_(self.steps).add_(self.levels)  # -inf for 0
        # NaN converts to int32's minimum, clamped to 0 (mag is finite here: top is)
        code = pos.floor_().clamp_(0, self.levels).to(torch.int32).clamp_(0, self.levels)
        code.sub_(torch.gt(self._level(code, top), mag).to(torch.int32))
        nxt = torch.add(code, 1).clamp_(max=self.levels)
        code.add_(torch.le(self._level(nxt, top), mag).logical_and_(code < self.levels).to(torch.int32))
        code.mul_(mag > 0)
        nxt = torch.add(code, 1).clamp_(max=self.levels)
        bad = torch.gt(self._level(code, top), mag)
        bad.logical_or_(torch.le(self._level(nxt, top), mag).logical_and_(code < self.levels))
        bad.logical_and_(mag > 0)
        if bool(bad.any()):  # an estimate off by more than one (subnormal blocks): binary search
            m = mag[bad]
            t = top.expand_as(mag)[bad]
            c = torch.zeros(m.shape, dtype=torch.int32)
            for bit in (128, 64, 32, 16, 8, 4, 2, 1):
                cand = torch.add(c, bit)
                ok = cand.le(self.levels).logical_and_(
                    torch.le(self._level(cand.clamp_(max=self.levels), t), m)
                )
                c.add_(ok.to(torch.int32), alpha=bit)
            code[bad] = c
        return code

    def _level(self, code: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """Each code's level in its block: grid[code] * top, the fp32 product decode forms."""
        return self._grid(code).mul_(top)

    def _grid(self, code: torch.Tensor) -> torch.Tensor:
        """Each code's level as a fraction of its block's maximum (code 0: 0.0), a table look-up."""
        return self.grid.index_select(0, code.view(-1)).view(code.shape)

    def _decode_checked(self, buf: torch.Tensor, out: torch.Tensor, native: bool | None) -> None:
        n = out.numel()
        scales, codes = self._split(buf, n)
        mod = use_native(native)
        if mod is not None:
            table = self.signed_grid if self.signed else self.grid
            mod.log_decode(scales, codes, out, table, self.signed, self.sqrt_domain)
            return
        for a, b in _passes(n):  # [Note: codec speed]
            self._decode(scales[a // BLOCK : math.ceil(b / BLOCK)], codes[a:b], out[a:b])

    def _decode(self, scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        table = self.signed_grid if self.signed else self.grid
        torch.index_select(table, 0, codes.to(torch.int32), out=out)
        full = n // BLOCK
        out[: full * BLOCK].view(full, BLOCK).mul_(scales[:full].view(full, 1))
        out[full * BLOCK :].mul_(scales[full:])  # the last, partial block (if any)
        if self.signed and bool(scales.isnan().any()):
            # NaN * -level keeps the NaN's sign; negating the product flips it: do as the latter
            bad = scales.isnan().repeat_interleave(BLOCK)[:n] & (codes >= 128)
            out[bad] = -out[bad]
        if self.sqrt_domain:
            out.mul_(out)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """On the stored value y (x, or sqrt(x)): below one grid step, (r - 1)|y| at or above the
        smallest level, below that level itself under it; in the sqrt domain |v' - v| = |s' - s|(s' + s)
        <= d(2s + d) for the bound d on s."""
        _flat_f32(x, f"{self.name} error_bound")
        y = self._blocks(x).abs()
        top = y.amax(dim=1, keepdim=True)
        low = top * self.low_fraction
        d = torch.where(y >= low, (self.step_ratio - 1.0) * y, low) * (1 + _FP32_SLACK) + top * _FP32_SLACK
        if self.sqrt_domain:
            d = d * (2 * y + d)
        return d.view(-1)[: x.numel()]
