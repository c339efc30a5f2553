"""Encode and decode time of each optimizer-state codec ([Note: compressed optimizer state]),
per tile as the offloaded optimizer calls them: ms per 1M elements, median of `--repeat` runs on
a tile of `--numel` elements of Adam-like moments (exp_avg ~ N(0, 1e-3), exp_avg_sq its square
plus noise), on `--threads` torch threads (default: torch's own), for each implementation: the
native kernels (tiered_ext, when built) and the pure-torch codecs (their fallback; same bits).

    python benchmarks/state_codecs.py [--numel 4194304] [--repeat 7] [--threads N] [--impl native,torch]

Prints one line per codec and implementation and a JSON object with the same numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from tiered.optim.rounding_noise import RoundingNoise, native_module
from tiered.optim.state_format import FORMATS


def _ms(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm the allocator and the kernels
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(numel: int, repeat: int, impl: str) -> list[dict[str, float | str]]:
    g = torch.Generator().manual_seed(0)
    m = torch.randn(numel, generator=g) * 1e-3
    v = m * m + torch.rand(numel, generator=g) * 1e-8
    out = []
    for fmt in ("fp32", "bf16", "int8"):
        for kind, x in (("exp_avg", m), ("exp_avg_sq", v)):
            codec = getattr(FORMATS[fmt], kind)
            buf = torch.empty(codec.encoded_bytes(numel), dtype=torch.uint8)
            dec = torch.empty(numel)
            native = impl == "native"
            noise = RoundingNoise(key=1)
            enc_ms = _ms(
                lambda codec=codec, x=x, buf=buf, noise=noise, native=native: codec.encode(
                    x, buf, noise, native=native
                ),
                repeat,
            )
            dec_ms = _ms(lambda codec=codec, buf=buf, dec=dec, native=native: codec.decode(buf, dec, native=native),
                         repeat)  # fmt: skip
            per = 1e6 / numel
            out.append(
                {
                    "impl": impl,
                    "format": fmt,
                    "moment": kind,
                    "encode_ms_per_1M": enc_ms * per,
                    "decode_ms_per_1M": dec_ms * per,
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--impl", default="native,torch", help="comma-separated: native, torch")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = [i for i in args.impl.split(",") if i != "native" or native_module() is not None]
    rows = [r for impl in impls for r in measure(args.numel, args.repeat, impl)]
    for r in rows:
        print(
            f"{r['impl']:>6} {r['format']:>5} {r['moment']:<10}  encode {r['encode_ms_per_1M']:7.2f} ms/1M  "
            f"decode {r['decode_ms_per_1M']:7.2f} ms/1M"
        )
    print(json.dumps({"numel": args.numel, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
