"""The nvme backend on the training pattern, against the raw O_DIRECT pool, round-robin.

[Note: nvme training-pattern benchmark]
Training does not move one big object: the tier manager has many partitions of 1-64 MiB (and a
layer's worth of sub-MiB ones) in flight at once, in swap mode (in place, no fsync). Each case
here replays one such pattern through the nvme backend opened as the engine opens its swap tiers
(``atomic=False, fsync=False, swap=True``), all partitions written concurrently, then all read
back concurrently, and compares it with the reference that moves the same bytes:

* ``raw 1 file, <case>'s memory``: tiered bench's ceiling (`tiered.bench.methods.ODirectMethod`:
  8 threads x 8 MiB O_DIRECT pwritev / preadv) moving the case's own source and destination
  mappings (as whole pages from their start, so also for a ragged or unaligned tensor: the same
  physical pages, a few bytes more) end to end into one contiguous file, in place (like a swap
  file after the first step) and without fsync (swap mode has none). So the only difference
  between a case and its reference is the backend: on this VM where a buffer's physical pages lie
  changes O_DIRECT rates by up to 1.5x, and a reference with memory of its own measured that,
  not the backend (the unaligned case at 0.69-0.80x of a reference on other mappings, 1.04-1.08x
  when its buffers were allocated right after them; reads into destinations first faulted in by
  8 threads at once 1.5x slower than into ones faulted in order);
* ``raw 16 files``: the same pool moving the large case's memory into the backend's own files;
* ``raw 1 file, one 1 GiB buffer`` (case ``onebuffer``), reported: one 1 GiB mapping of its own
  into the same file, 1.1-1.25x faster here than 16 separate 64 MiB mappings, likely because a
  large mapping faulted in order is more often physically contiguous, so the virtio disk's
  requests (at most 254 segments) carry more bytes each. Training's partitions are separate
  allocations, like the 16 mappings.

Every source holds random bytes (a never-written buffer is the kernel's zero page, which a virtual
disk may write faster than real data: 3.3 vs 2.1-2.4 GB/s on the same files here).

Both sides use O_DIRECT, so neither read is served by the page cache (on a VM,
posix_fadvise(DONTNEED) may not drop the host's cache, and a buffered read could beat the disk).
Every round runs every case and reference once, in an order rotated by one per round; the table
gives the median GB/s (1e9 B/s) over rounds, the spread (min-max), and each case's ratio to its
reference measured in the same rounds, against the targets of the nvme backend:

* ``large`` (16 x 64 MiB) and ``mixed`` (1-64 MiB): >= 0.9x their reference, writes and reads;
* ``unaligned`` (16 x 64 MiB starting 64 B past a page, as ``torch.empty`` buffers do): >= 0.8x;
* ``small`` (a layer's worth of 64 KiB - 1 MiB partitions): >= 0.7x the ``large`` case's rate;
* ``stripe2`` (the stripe backend over two directories of the same disk, its members opened as
  the engine's swap tiers are, moving the large case's memory): >= 0.9x the ``large`` case (one
  directory), writes and reads: on one disk striping cannot be faster, so this is its overhead
  ([Note: stripe scratch mode]: in place, as swap files are); ``stripe2atomic``, reported: the
  same with ``"atomic": true``, a fresh generation and a commit record per write.

Every read is checked against what was written (outside the timing).

    python benchmarks/nvme_pattern.py --dir /mnt/nvme/tmp --rounds 5
    python benchmarks/nvme_pattern.py --rounds 5 --write-results   # refresh its RESULTS.md section
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiered.bench.methods import ODirectMethod, aligned_buffer, read_chunk, write_chunk
from tiered.storage.registry import open_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import write_section  # a sibling script, found through its folder

MIB = 1 << 20
KIB = 1 << 10
UNALIGNED_BY = 64  # where torch.empty's allocations start: 64 B past a page
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADING = "## nvme backend on the training pattern"


# ---- the patterns -----------------------------------------------------------------------------
def large_sizes() -> list[int]:
    return [64 * MIB] * 16


def mixed_sizes(seed: int = 7) -> list[int]:
    """1-64 MiB, whole pages plus a ragged tail on some (real partitions are not page multiples)."""
    rng = random.Random(seed)
    sizes = [rng.choice((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)) * MIB for _ in range(12)]
    return [s - rng.choice((0, 0, 4, 1000)) for s in sizes]


def small_sizes(seed: int = 11) -> list[int]:
    """A layer's worth of small partitions: norms, biases, small projections (64 KiB - 1 MiB)."""
    rng = random.Random(seed)
    return [rng.choice((64, 128, 256, 512, 768, 1024)) * KIB for _ in range(160)]


@dataclass
class Buffers:
    """Sources and destinations of one pattern: each a mapping of whole pages of its own, the
    tensor at its start or 64 B past it (where torch.empty's 64-byte-aligned allocations land)."""

    sizes: list[int]
    aligned: bool
    keep: list[Any] = field(default_factory=list)
    src: list[torch.Tensor] = field(default_factory=list)
    dst: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(len(self.sizes))
        for n in self.sizes:
            for out in (self.src, self.dst):
                past = 0 if self.aligned else UNALIGNED_BY
                mm, t = aligned_buffer(_pad(n + past))  # whole pages: see pages()
                self.keep.append(mm)
                out.append(t[past : past + n])
        for t in self.src:
            t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, generator=gen))
        for t in self.dst:
            # faulted in here, in order, by one thread (as the sources are by their fill): left to
            # the first O_DIRECT read, 8 threads fault them in at once, and the physical pages come
            # out more scattered, which on this VM's disk made reads into them 1.5x slower
            t.zero_()

    def check(self, what: str) -> None:
        for i, (s, d) in enumerate(zip(self.src, self.dst, strict=True)):
            if not torch.equal(s, d):
                raise SystemExit(f"{what}: partition {i} ({s.numel()} B) read back different bytes")
            d.zero_()

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def pages(self) -> list[tuple[memoryview, memoryview]]:
        """Each partition's source and destination mappings as whole pages from their start: the
        memory the raw pool moves with O_DIRECT as the case's reference (the same physical pages,
        whatever the tensors' offset and ragged tail)."""
        return [
            (memoryview(self.keep[2 * i]), memoryview(self.keep[2 * i + 1])) for i in range(len(self.sizes))
        ]


# ---- what is timed ----------------------------------------------------------------------------
class BackendCase:
    """A pattern through one backend spec: every partition written at once, then read at once."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        bufs: Buffers,
        loop: asyncio.AbstractEventLoop,
        *,
        prefix: str = "p",
        share: BackendCase | None = None,
    ):
        self.name, self.bufs, self.loop, self.total = name, bufs, loop, bufs.total
        self.owner = share is None
        self.backend = open_backend(spec) if share is None else share.backend
        self.keys = [f"{prefix}{i:04d}" for i in range(len(bufs.sizes))]

    def write(self) -> float:
        t0 = time.perf_counter()
        self.loop.run_until_complete(
            _gather([self.backend.write(k, t) for k, t in zip(self.keys, self.bufs.src, strict=True)])
        )
        return time.perf_counter() - t0

    def read(self) -> float:
        t0 = time.perf_counter()
        self.loop.run_until_complete(
            _gather([self.backend.read(k, t) for k, t in zip(self.keys, self.bufs.dst, strict=True)])
        )
        dt = time.perf_counter() - t0
        self.bufs.check(self.name)
        return dt

    def close(self) -> None:
        if self.owner:
            self.loop.run_until_complete(self.backend.close())


async def _gather(calls: list[Any]) -> None:
    await asyncio.gather(*calls)


class RawCase:
    """The raw O_DIRECT pool of `tiered bench` (its threads, its chunking) moving `bufs` (written
    from their sources, read into their destinations, as whole pages: `Buffers.pages`) one region
    per partition, in place (the files are made at their sizes first, as swap files are after the
    first step): one file per region, or every region end to end in one file when `files` has one
    path."""

    def __init__(self, name: str, pool: ODirectMethod, files: list[Path], bufs: Buffers, *, own: bool):
        self.name, self.pool, self.files, self.own, self.bufs = name, pool, files, own, bufs
        self.total = bufs.total
        src, dst = (list(side) for side in zip(*bufs.pages(), strict=True))
        one_file = len(files) == 1
        bases = [sum(len(m) for m in src[:i]) if one_file else 0 for i in range(len(src))]
        # (file index, file offset of the region, source, destination)
        self.regions = [
            (0 if one_file else i, b, s, d) for i, (b, s, d) in enumerate(zip(bases, src, dst, strict=True))
        ]
        if own:
            ends: dict[int, int] = {}
            for f, b, mv, _ in self.regions:
                ends[f] = max(ends.get(f, 0), b + len(mv))
            for f, end in ends.items():
                files[f].parent.mkdir(parents=True, exist_ok=True)
                with open(files[f], "wb") as fh:
                    fh.truncate(end)

    def _all(self, flags: int, op: Callable[..., None], write: bool) -> float:
        t0 = time.perf_counter()
        fds = [os.open(p, flags | os.O_DIRECT) for p in self.files]
        try:
            n = self.pool.chunk
            futures = [
                self.pool.pool.submit(op, fds[f], src if write else dst, off, min(n, len(src) - off), base)
                for f, base, src, dst in self.regions
                for off in range(0, len(src), n)
            ]
            for fut in futures:
                fut.result()
        finally:
            for fd in fds:
                os.close(fd)
        return time.perf_counter() - t0

    def write(self) -> float:
        return self._all(os.O_WRONLY, write_chunk, True)

    def read(self) -> float:
        dt = self._all(os.O_RDONLY, read_chunk, False)
        for t in self.bufs.dst:  # what it read is the case's bytes: never let them pass its check
            t.zero_()
        return dt

    def close(self) -> None:
        if self.own:
            for p in self.files:
                p.unlink(missing_ok=True)


def _pad(n: int) -> int:
    return (n + 4095) // 4096 * 4096


# ---- the run ----------------------------------------------------------------------------------
@dataclass
class Figures:
    write: list[float] = field(default_factory=list)
    read: list[float] = field(default_factory=list)


def gbps(nbytes: int, seconds: list[float]) -> list[float]:
    return [nbytes / s / 1e9 for s in seconds]


def run(args: argparse.Namespace) -> str:
    """Build the cases, warm each up once, then `args.rounds` rotated rounds; the table."""
    root = Path(tempfile.mkdtemp(prefix="tiered-nvme-pattern-", dir=args.dir))
    loop = asyncio.new_event_loop()
    pool = ODirectMethod()
    cases: dict[str, Any] = {}
    try:
        build_cases(args.cases.split(","), root, pool, loop, cases)
        names = list(cases)
        figs = {n: Figures() for n in names}
        for c in cases.values():  # warm-up: files allocated, buffers faulted in, pools filled
            c.write()
            c.read()
        for r in range(args.rounds):
            # each case writes then reads its own bytes (cases may share files: see build_cases)
            for n in names[r % len(names) :] + names[: r % len(names)]:
                figs[n].write.append(cases[n].write())
                figs[n].read.append(cases[n].read())
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        return table(figs, {n: c.total for n, c in cases.items()})
    finally:
        for c in cases.values():
            c.close()
        pool.close()
        loop.close()
        shutil.rmtree(root, ignore_errors=True)


def build_cases(
    wanted: list[str], root: Path, pool: ODirectMethod, loop: asyncio.AbstractEventLoop, cases: dict[str, Any]
) -> None:
    """The cases of `wanted` into `cases`. To keep the disk footprint near 2 GiB (plus 1 GiB per
    stripe case), the unaligned case and "raw 16 files" reuse the large case's files, and the mixed
    reference a prefix of the 1 GiB raw file (every case writes before it reads, so sharing files
    or memory changes no figure)."""
    unknown = sorted(set(wanted) - set(CASES))
    if unknown:
        raise SystemExit(f"nvme_pattern: unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    swap = {"atomic": False, "fsync": False, "swap": True}
    nvme = {"type": "nvme", "path": str(root / "one"), **swap}
    (root / "one").mkdir()
    big = Buffers(large_sizes(), True)
    raw_file = [root / "raw" / "one.bin"]
    raw1 = RawCase(reference("large"), pool, raw_file, big, own=True)
    cases[raw1.name] = raw1
    if "onebuffer" in wanted:
        cases[ONE_BUFFER] = RawCase(ONE_BUFFER, pool, raw_file, Buffers([big.total], True), own=False)
    large = BackendCase("large", nvme, big, loop)
    cases["large"] = large
    if "raw16" in wanted:
        files = [large.backend.directory / k for k in large.keys]
        large.write()
        cases["raw 16 files"] = RawCase("raw 16 files", pool, files, big, own=False)
    if "mixed" in wanted:
        mixed = Buffers(mixed_sizes(), True)
        ref = RawCase(reference("mixed"), pool, raw_file, mixed, own=False)
        cases[ref.name] = ref
        cases["mixed"] = BackendCase("mixed", nvme, mixed, loop, prefix="m")
    if "unaligned" in wanted:
        off = Buffers(large_sizes(), False)
        ref = RawCase(reference("unaligned"), pool, raw_file, off, own=False)
        cases[ref.name] = ref
        cases["unaligned"] = BackendCase("unaligned", nvme, off, loop, share=large)
    if "small" in wanted:
        cases["small"] = BackendCase("small", nvme, Buffers(small_sizes(), True), loop, prefix="s")
    for name, atomic in (("stripe2", None), ("stripe2atomic", True)):
        if name in wanted:
            # the large case's memory: the same bytes from the same pages, only the backend differs
            dirs = [root / name / "s0", root / name / "s1"]
            for d in dirs:
                d.mkdir(parents=True)
            spec: dict[str, Any] = {
                "type": "stripe",
                "stripe_bytes": "8MiB",
                "paths": [str(d) for d in dirs],
                "member_options": swap,
            }
            if atomic is not None:
                spec["atomic"] = atomic
            cases[name] = BackendCase(name, spec, big, loop)


CASES = ("large", "raw16", "onebuffer", "mixed", "unaligned", "small", "stripe2", "stripe2atomic")
ONE_BUFFER = "raw 1 file, one 1 GiB buffer"


def reference(case: str) -> str:
    """The name of the raw pool moving `case`'s own memory into one file."""
    return f"raw 1 file, {case}'s memory"


TARGETS = {  # case: (reference, target ratio)
    "large": (reference("large"), 0.9),
    "mixed": (reference("mixed"), 0.9),
    "unaligned": (reference("unaligned"), 0.8),
    "small": ("large", 0.7),
    "stripe2": ("large", 0.9),
    "stripe2atomic": ("large", None),
    "raw 16 files": (reference("large"), None),
    ONE_BUFFER: (reference("large"), None),
}


def table(figs: dict[str, Figures], total: dict[str, int]) -> str:
    rows = [
        "| case | bytes | write GB/s median (min-max) | read GB/s median (min-max) | reference | "
        "write ratio | read ratio | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    med: dict[str, tuple[float, float]] = {}
    for n, f in figs.items():
        w, r = gbps(total[n], f.write), gbps(total[n], f.read)
        med[n] = (statistics.median(w), statistics.median(r))
    for n, f in figs.items():
        w, r = gbps(total[n], f.write), gbps(total[n], f.read)
        ref, target = TARGETS.get(n, (None, None))
        wr = rr = "-"
        if ref in med:
            wr = f"{med[n][0] / med[ref][0]:.2f}x"
            rr = f"{med[n][1] / med[ref][1]:.2f}x"
        verdict = "-"
        if target is not None and ref in med:
            ok = med[n][0] / med[ref][0] >= target and med[n][1] / med[ref][1] >= target
            verdict = f">= {target}x: {'met' if ok else 'NOT met'}"
        rows.append(
            f"| {n} | {total[n] / MIB:.0f} MiB | {med[n][0]:.2f} ({min(w):.2f}-{max(w):.2f}) | "
            f"{med[n][1]:.2f} ({min(r):.2f}-{max(r):.2f}) | {ref or '-'} | {wr} | {rr} | {verdict} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to measure (default: the temp dir)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="round-robin rounds after one warm-up (default 5)"
    )
    parser.add_argument(
        "--cases", default="large,mixed,unaligned,small,stripe2,stripe2atomic", help="comma-separated cases"
    )
    parser.add_argument("--write-results", action="store_true", help=f"replace '{HEADING}' in RESULTS.md")
    args = parser.parse_args(argv)
    before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    text = run(args)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    sys.stdout.write(text)
    print(f"uptime before: {before}\nuptime after:  {after}", file=sys.stderr)
    if args.write_results:
        shown = " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-results")
        write_section(
            RESULTS,
            section(text, f"python benchmarks/nvme_pattern.py {shown}".strip(), before, after),
            HEADING,
        )
    return 0


def section(text: str, command: str, before: str, after: str) -> str:
    return (
        f"{HEADING}\n\nWritten by `benchmarks/nvme_pattern.py --write-results`; see its "
        "[Note: nvme training-pattern benchmark] for what each case moves.\n\n"
        f"Command: `{command}`\n\n`uptime` before: `{before}`; after: `{after}`\n\n"
        "Both sides use O_DIRECT (the nvme backend and the raw pool of `tiered bench`, 8 threads x "
        "8 MiB), so no read is served by the page cache, which on this VM posix_fadvise(DONTNEED) "
        "may not drop. Every case and reference runs once per round (each writes, then reads back "
        "and checks its own bytes), in an order rotated by one per round, after one warm-up round "
        "that allocates the files; GB/s = 1e9 B/s; median (min-max) over the rounds; ratios are "
        "of medians from the same rounds. The nvme backend is opened as the engine opens its "
        "offload tiers (`swap=True, atomic=False, fsync=False`). The machine is a 2-core VM shared "
        "with up to 8 agents (see the load above): single figures swing by 2x between rounds, so "
        "read the ratios, not the absolute rates.\n\n" + text + "\n" + FINDINGS
    )


FINDINGS = """What was slow and what changed (the nvme backend in swap mode):

- **Large partitions** (16 x 64 MiB, mixed 1-64 MiB): the backend already used the raw pool's
  chunking (8 MiB pieces) and width (8 workers: its `CapacityLimiter` equals the pool's 8
  threads), with every piece of every partition queued at once; the per-object cost (an `open`,
  an `fstat` per read and per write, a `close`: three or four thread handoffs) is small next to
  a 64 MiB move. Before this change the same script (2 rounds, load average 6-14) gave large
  1.05x / 0.98x (write / read), mixed 1.10x / 1.17x, unaligned 0.61x / 0.65x and small
  0.16x / 0.42x: the 0.45x / 0.72x of issue 15 did not reproduce in swap mode with O_DIRECT on
  both sides. Swap mode now keeps each key's size in memory ([Note: nvme swap index]): no
  `fstat`, and no `ftruncate` unless an object shrank by over a quarter.
- **Unaligned caller tensors** (`torch.empty`, 64 B past a page) went through the bounce buffer
  chunk by chunk: a memcpy of every byte on each write and read, on a CPU-starved machine. Swap
  files now store such a payload at the caller's shift ([Note: nvme shifted swap files]): all but
  a head and a tail block move straight between the tensor and the file.
- **Small partitions** (64 KiB - 1 MiB): one file each, with an `open`, a `close`, several thread
  handoffs and one small device request per partition. They now share one slab file, and the
  requests issued together are merged into vectored syscalls of up to 8 MiB
  ([Note: nvme slab coalescing]: the 160 partitions here move in 15 syscalls instead of about
  480 calls). What is left is per-object Python work on the event loop (key check, lock, future,
  tensor views: tens of microseconds each, much more on a CPU-starved VM), which 66 MiB in ~30 ms
  does not amortize.
- **Striping over two directories** (one disk): the stripe backend wrote each stripe as a fresh
  generation object with a commit record and deleted the old ones, which costs the allocation and
  metadata work that swap files avoid (0.36-0.63x of one directory). Over scratch members it now
  rewrites an unchanged layout in place ([Note: stripe scratch mode]); `stripe2atomic` keeps the
  fresh generation per write.
"""


if __name__ == "__main__":
    sys.exit(main())
