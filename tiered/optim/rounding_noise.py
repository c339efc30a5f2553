"""The stochastic rounding noise of the optimizer-state codecs (tiered/optim/state_codecs.py).

[Note: counter-based rounding noise]
The stochastic rounding's randomness is not drawn from a generator (a native kernel cannot
reproduce torch's stream, and a sequential stream ties the bits to how a tensor is cut): each
element's noise is a hash of a 64-bit key and the element's index. `RoundingNoise(key, offset)`
names both: element i of an encode has index offset + i, and its 32-bit word is
lowbias32((index mod 2^32) xor k), k the low 32 bits of splitmix64(key + index // 2^32) (one k
per 2^32 indices; lowbias32 is C. Wellons' integer hash, a bijection with full avalanche, so the
words of one key are uniform and different keys' words are unrelated). bf16 adds the word's
high 16 bits to the fp32 pattern; int8 rounds up when (word >> 8) / 2^24 < the remainder's
fraction. The optimizer's key (tiered/optim/state_format.py `rounding_noise`) hashes the step
count, the moment and the group, and the offset is the tile's first element in the group's
global flat buffer: the noise is a function of what a checkpoint already holds, so a resumed
run rounds exactly as the uninterrupted one, and the bits do not depend on torch's thread
count, the tile size (sub_group_size's tiles) or the world size (an element keeps its global
index in its group; the group is named by its index, so a run that forms other groups rounds
otherwise, as its int8 blocks would differ anyway). Different steps
and moments get unrelated words. The torch version computes the same words in int32 arithmetic
(a product wraps mod 2^32; an arithmetic shift is masked to a logical one).
The 8-bit lower code is defined without log2: the largest c with level(c) = grid[c] * top <= |y|
(fp32 products, the levels decode gives), and 0 for |y| = 0. Both versions start the search from
a log2 estimate (torch's vectorised log2, a polynomial in the kernel) and correct it by comparing
with the levels, so a value within an ulp of a level gets the same code everywhere (a log2 that
differs in the last bit cannot change it). A block whose maximum is inf or NaN stores a NaN scale
and, per element, only the sign bit of a signed code (it decodes as NaN with that sign).
The sqrt domain's square root is the correctly rounded one in both (torch's vectorised fp32 sqrt
was seen 1 ulp off it here, so the torch codec takes it in float64 and rounds once to fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def splitmix64(z: int) -> int:
    """splitmix64's output function of `z` (mod 2**64): the key mixer of [Note: counter-based rounding noise]."""
    z = (z + 0x9E37_79B9_7F4A_7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return z ^ (z >> 31)


def noise_key(*parts: int) -> int:
    """A 64-bit key hashed from `parts` (non-negative ints), each mixed in turn."""
    key = 0
    for p in parts:
        key = splitmix64(key ^ (p & _M64))
    return key


@dataclass(frozen=True)
class RoundingNoise:
    """The stochastic rounding's noise of one encode ([Note: counter-based rounding noise]):
    element i of the encoded tensor gets the word of index `offset` + i under `key`."""

    key: int = 0
    offset: int = 0

    def at(self, start: int) -> RoundingNoise:
        """The same noise for the encode of the elements from `start` on."""
        return RoundingNoise(self.key, self.offset + start)


def _i32(v: int) -> int:
    """The int32 whose bits are the 32-bit `v`."""
    return v - (1 << 32) if v >= 1 << 31 else v


def noise_words(noise: RoundingNoise, n: int) -> torch.Tensor:
    """The 32-bit noise words of elements 0..n-1 under `noise`, as int32 bit patterns (torch ops:
    the definition the native kernels are tested against)."""
    out = torch.empty(n, dtype=torch.int32)
    pos = 0
    while pos < n:
        index = noise.offset + pos
        lo = index & _M32
        m = min(n - pos, (1 << 32) - lo)  # one segment key per 2**32 indices
        k = splitmix64((noise.key + (index >> 32)) & _M64) & _M32
        x = torch.arange(m, dtype=torch.int32, out=out[pos : pos + m]).add_(_i32(lo)).bitwise_xor_(_i32(k))
        # lowbias32; int32 products wrap mod 2**32, the arithmetic shifts are masked to logical ones
        x.bitwise_xor_(x.bitwise_right_shift(16).bitwise_and_(0xFFFF)).mul_(0x7FEB352D)
        x.bitwise_xor_(x.bitwise_right_shift(15).bitwise_and_(0x1FFFF)).mul_(_i32(0x846CA68B))
        x.bitwise_xor_(x.bitwise_right_shift(16).bitwise_and_(0xFFFF))
        pos += m
    return out


def native_module() -> ModuleType | None:
    """tiered_ext's native CPU module when it is built (it holds the native codecs), else None."""
    from tiered_ext import _loader  # (tiered_ext imports tiered while it initialises)

    return _loader.cpu_module()


def use_native(native: bool | None) -> ModuleType | None:
    """The native module a codec call with `native` (None / False / True, as `encode`'s) uses."""
    if native is False:
        return None
    mod = native_module()
    if mod is None and native:
        raise RuntimeError("the native state codecs are not built (tiered_ext's CPU module is unavailable)")
    return mod
