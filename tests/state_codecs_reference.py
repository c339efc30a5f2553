"""The optimizer-state codecs as first written (plain per-element torch ops: exp2 and where per
level, randint per bf16 noise): the oracle tiered/optim/state_codecs.py's faster ones must equal
bit for bit ([Note: codec speed]). Signatures as the codecs': encode(x, out, generator),
decode(buf, out)."""

from __future__ import annotations

import math

import torch

from tiered.optim.state_codecs import _BF16_SAFE, BLOCK


def bf16_encode(x: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None) -> None:
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator)
    out.view(torch.int16).copy_(bits.add(noise).bitwise_right_shift_(16))
    if x.numel() and not float(x.abs().amax()) <= _BF16_SAFE:
        odd = ~torch.isfinite(x) | (x.abs() > _BF16_SAFE)
        out.view(torch.bfloat16)[odd] = x[odd].to(torch.bfloat16)


class BlockLog:
    def __init__(self, *, signed: bool, steps: int, sqrt_domain: bool = False) -> None:
        self.signed, self.steps, self.sqrt_domain = signed, steps, sqrt_domain
        self.levels = 127 if signed else 255

    def _level(self, top: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        mag = top * torch.exp2((code.float() - self.levels) / self.steps)
        return torch.where(code > 0, mag, top * 0.0)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clamp_min(0).sqrt() if self.sqrt_domain else x
        nb = math.ceil(x.numel() / BLOCK)
        if nb * BLOCK != x.numel():
            y = torch.nn.functional.pad(y, (0, nb * BLOCK - x.numel()))
        return y.view(nb, BLOCK)

    def encode(self, x: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None) -> None:
        n = x.numel()
        nb = math.ceil(n / BLOCK)
        scales, codes = out[: 4 * nb].view(torch.float32), out[4 * nb :]
        if n == 0:
            return
        y = self._blocks(x)
        mag = y.abs()
        top = mag.amax(dim=1, keepdim=True)
        scales.copy_(torch.where(torch.isfinite(top), top, math.nan).view(-1))
        safe = torch.where(top > 0, top, torch.ones_like(top))
        pos = self.levels + self.steps * torch.log2(mag / safe)
        lo_code = pos.floor().clamp_(0, self.levels).to(torch.int16)
        hi_code = (lo_code + 1).clamp_(max=self.levels)
        lo, hi = self._level(top, lo_code), self._level(top, hi_code)
        width = hi - lo
        up = torch.where(width > 0, (mag - lo) / torch.where(width > 0, width, torch.ones_like(width)), 0.0)
        u = torch.rand(y.shape, generator=generator)
        code = torch.where(u < up, hi_code, lo_code)
        if self.signed:
            code = code | torch.where(y < 0, 128, 0).to(torch.int16)
        codes.copy_(code.view(-1)[:n].to(torch.uint8))

    def decode(self, buf: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        if n == 0:
            return
        nb = math.ceil(n / BLOCK)
        scales, codes = buf[: 4 * nb].view(torch.float32), buf[4 * nb :]
        c = torch.zeros(nb * BLOCK, dtype=torch.int16)
        c[:n] = codes.to(torch.int16)
        c = c.view(nb, BLOCK)
        top = scales.view(nb, 1)
        if self.signed:
            val = self._level(top, c & 127)
            val = torch.where(c >= 128, -val, val)
        else:
            val = self._level(top, c)
        if self.sqrt_domain:
            val = val * val
        out.copy_(val.view(-1)[:n])
