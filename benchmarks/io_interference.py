"""What NVMe traffic alone costs the compute on this machine: the floor under any offload engine.

Runs the plain PyTorch step of benchmarks/step.py (the 35.7M-param Llama, all in memory) alone,
then again while background threads move a given number of bytes per step through raw O_DIRECT
pwritev/preadv (8 MiB chunks, half writes, half reads, on a file in --dir), paced to the rate
that the step time implies. No tiered code runs: if this ratio is already above 1.1, no
offload engine moving those bytes can step within 1.1x of plain PyTorch here, however well it
overlaps, because the I/O itself takes CPU from the compute (syscalls, page pinning, interrupts;
on a 2-vCPU VM every cycle counts). Rounds alternate alone / with I/O; medians are reported.

    python benchmarks/io_interference.py --dir DIR [--mb-per-step 570 285] [--rounds 3]

It then probes where the cost goes: a 1024x1024 fp32 matmul loop's throughput for 4 s alone
and 4 s next to unthrottled O_DIRECT I/O, with the steal time the kernel recorded meanwhile
(/proc/stat) and the CPU seconds this process spent on the I/O itself (getrusage).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import build_model, make_data

CHUNK = 8 << 20
FILE_BYTES = 512 << 20


class PacedIO:
    """Threads issuing O_DIRECT writes and reads of CHUNK bytes at `rate` bytes/s in total."""

    def __init__(self, path: Path, rate: float, threads: int = 4) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.ftruncate(self.fd, FILE_BYTES)
        self.rate, self.stop, self.moved = rate, threading.Event(), 0
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(i, threads), daemon=True) for i in range(threads)
        ]

    def _run(self, i: int, n: int) -> None:
        buf = mmap.mmap(-1, CHUNK)  # page aligned, as O_DIRECT needs
        t0, k = time.perf_counter(), 0
        per_thread = self.rate / n
        while not self.stop.is_set():
            if k * CHUNK > per_thread * (time.perf_counter() - t0):
                time.sleep(0.0005)
                continue
            off = ((k * n + i) * CHUNK) % FILE_BYTES
            if k % 2 == 0:
                os.pwritev(self.fd, [buf], off)
            else:
                os.preadv(self.fd, [buf], off)
            k += 1
            with self._lock:
                self.moved += CHUNK

    def __enter__(self) -> PacedIO:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        os.close(self.fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir", required=True, help="directory on the drive to load (a 512 MiB file is made there)"
    )
    ap.add_argument(
        "--mb-per-step",
        type=float,
        nargs="+",
        default=[570.0, 285.0],
        help="bytes moved per plain step, in MB (default: tiered's 285+285, and half of it)",
    )
    ap.add_argument("--steps", type=int, default=6, help="timed steps per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model = build_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    batch = make_data(1)[0]

    def steps(n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    steps(2)  # warm-up
    path = Path(args.dir) / "io_interference.bin"
    alone: list[float] = []
    loaded: dict[float, list[tuple[float, float]]] = {mb: [] for mb in args.mb_per_step}
    try:
        for _ in range(args.rounds):
            alone.append(steps(args.steps))
            for mb in args.mb_per_step:
                rate = mb * 1e6 / alone[-1]
                with PacedIO(path, rate) as io:
                    t0 = time.perf_counter()
                    s = steps(args.steps)
                    got = io.moved / (time.perf_counter() - t0)
                loaded[mb].append((s, got * s / 1e6))
    finally:
        path.unlink(missing_ok=True)
    probe = matmul_probe(path)
    base = statistics.median(alone)
    print(
        f"\nplain PyTorch step, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps: "
        f"{base:.3f} s alone\n"
    )
    print("| background O_DIRECT I/O | MB moved per step (measured) | s/step | x alone |")
    print("|---|---|---|---|")
    for mb, rows in loaded.items():
        s = statistics.median(r[0] for r in rows)
        moved = statistics.median(r[1] for r in rows)
        print(f"| {mb:.0f} MB/step target | {moved:.0f} | {s:.3f} | {s / base:.2f} |")
    print(
        f"\nmatmul probe: {probe['alone']:.1f} matmuls/s alone, {probe['io']:.1f} next to unthrottled I/O "
        f"({probe['io'] / probe['alone']:.2f}x) moving {probe['io_gbps']:.2f} GB/s; steal recorded "
        f"{probe['steal_alone']:.2f} s vs {probe['steal_io']:.2f} s over 4 s; this process's CPU for the I/O alone: "
        f"{probe['io_cpu_per_gb']:.3f} s per GB"
    )
    return 0


def _steal_s() -> float:
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def matmul_probe(path: Path, seconds: float = 4.0) -> dict[str, float]:
    a = torch.randn(1024, 1024)

    def loop() -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ a
            n += 1
        return n / seconds

    out: dict[str, float] = {}
    s0 = _steal_s()
    out["alone"] = loop()
    out["steal_alone"] = _steal_s() - s0
    try:
        with PacedIO(path, rate=1e12) as io:  # unthrottled
            s0, t0 = _steal_s(), time.perf_counter()
            out["io"] = loop()
            out["steal_io"] = _steal_s() - s0
            out["io_gbps"] = io.moved / (time.perf_counter() - t0) / 1e9
        # the I/O's own CPU: the same kind of I/O with nothing else running
        with PacedIO(path, rate=1e12) as io:
            c0, t0 = _cpu_s(), time.perf_counter()
            time.sleep(2.0)
            moved, cpu = io.moved, _cpu_s() - c0
        out["io_cpu_per_gb"] = cpu / max(moved / 1e9, 1e-9)
    finally:
        path.unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
