"""Run the bandwidth methods round-robin and report GB/s and ratios to the O_DIRECT ceiling.

[Note: round-robin measurement]
Disks (and the VMs in front of them) drift by tens of percent within minutes, so methods timed
one after another are not comparable. Each round runs every method once, write then cold read,
in an order rotated by one each round; the figure is the median over the measured rounds, after
`warmup_rounds` unrecorded ones. Between a method's write and its read the file is flushed and
dropped from the page cache (posix_fadvise DONTNEED), so reads come from the device. Every read
is checked byte for byte against the source (outside the timing): a method that returns wrong
bytes is reported as an error, never as a speed. A method that fails is reported with its error
and leaves the remaining rounds; the others go on (and `tiered bench` then exits non-zero).

Possibly cached reads: in a VM, DONTNEED does not drop the host's cache, so a "cold" read can
come from RAM. The O_DIRECT ceiling bypasses every guest cache, so a method whose median read
beats the ceiling's median read by more than `CACHED_MARGIN` cannot have come from the device
alone: it is flagged "possibly cached" in its row (and ``possibly_cached`` in JSON), not hidden.
CPU cost: the process CPU time (all threads, `time.process_time`) around each timed write and
read, per GB moved, so a backend that spends cores to reach its GB/s shows it.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiered.bench.methods import (
    ALIGN,
    MIB,
    BackendMethod,
    Method,
    ODirectMethod,
    aligned_buffer,
    drop_cache,
    find_deepspeed_aio,
    find_fio,
    remove_tree,
    sync_files,
)
from tiered.bench.preflight import check_free_space, check_memory
from tiered.bench.progress import add_total
from tiered.errors import ConfigError, StorageIOError, TieredError
from tiered.units import format_bytes

log = logging.getLogger(__name__)

DEFAULT_BACKENDS = ("nvme", "aiofiles", "tensorstore")
CACHED_MARGIN = 1.10
"""A read faster than this x the O_DIRECT ceiling's is flagged possibly cached."""


@dataclass(frozen=True)
class BenchOptions:
    """What to measure; sizes in bytes."""

    directory: Path
    size_bytes: int = 1 << 30
    rounds: int = 5
    warmup_rounds: int = 1
    threads: int = 8
    chunk_bytes: int = 8 * MIB
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    specs: tuple[dict[str, Any], ...] = ()
    """Full backend specs (``--spec``), opened as given."""
    fio: bool = True
    deepspeed: bool = True
    timeout_s: float | None = None
    """Per operation; None = generous for the size (at least 60 s, 20 MB/s worst case)."""

    def __post_init__(self) -> None:
        if self.size_bytes < ALIGN:
            raise ConfigError(f"--size: {self.size_bytes} B is below the {ALIGN} B minimum")
        if self.rounds < 1 or self.warmup_rounds < 0:
            raise ConfigError(
                f"--rounds must be >= 1 (got {self.rounds}) and warm-up >= 0 (got {self.warmup_rounds})"
            )
        if self.threads < 1 or self.chunk_bytes < ALIGN or self.chunk_bytes % ALIGN:
            raise ConfigError(f"threads must be >= 1 and chunk a multiple of {ALIGN} B")

    @property
    def aligned_size(self) -> int:
        """O_DIRECT moves whole blocks: the size is rounded up to 4 KiB."""
        return -(-self.size_bytes // ALIGN) * ALIGN

    @property
    def op_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else max(60.0, self.aligned_size / 20e6)


@dataclass(frozen=True)
class MethodResult:
    name: str
    kind: str
    status: str
    """"ok", "absent" or "error"."""
    detail: str = ""
    write_s: tuple[float, ...] = ()
    read_s: tuple[float, ...] = ()
    write_gbps: float | None = None
    read_gbps: float | None = None
    write_vs_ceiling: float | None = None
    read_vs_ceiling: float | None = None
    write_cpu_s_per_gb: float | None = None
    read_cpu_s_per_gb: float | None = None
    possibly_cached: bool = False
    """Median read faster than CACHED_MARGIN x the ceiling's (see the Note)."""


@dataclass(frozen=True)
class BenchResult:
    size_bytes: int
    directory: str
    filesystem: str
    rounds: int
    warmup_rounds: int
    date: str
    machine: dict[str, Any]
    methods: tuple[MethodResult, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["methods"] = [asdict(m) for m in self.methods]
        return out

    def to_markdown(self) -> str:
        lines = [
            f"{format_bytes(self.size_bytes, binary=True)} per transfer, directory {self.directory} "
            f"({self.filesystem}); {self.rounds} round-robin rounds after {self.warmup_rounds} warm-up, median; "
            "reads cold (fadvise DONTNEED); writes include fsync",
            "",
            "| method | kind | write GB/s | read GB/s | write / O_DIRECT | read / O_DIRECT | status |",
            "|---|---|---|---|---|---|---|",
        ]

        def f(x: float | None, digits: int = 2) -> str:
            return "-" if x is None else f"{x:.{digits}f}"

        for m in self.methods:
            status = m.status if not m.detail else f"{m.status}: {m.detail}"
            if m.possibly_cached:
                status += " (read possibly cached: faster than the O_DIRECT ceiling)"
            lines.append(
                f"| {m.name} | {m.kind} | {f(m.write_gbps)} | {f(m.read_gbps)} | "
                f"{f(m.write_vs_ceiling)} | {f(m.read_vs_ceiling)} | {status} |"
            )
        measured = [m for m in self.methods if m.write_cpu_s_per_gb is not None]
        if measured:
            lines += ["", "| method | CPU s per GB written | CPU s per GB read |", "|---|---|---|"]
            lines += [
                f"| {m.name} | {f(m.write_cpu_s_per_gb, 3)} | {f(m.read_cpu_s_per_gb, 3)} |" for m in measured
            ]
        return "\n".join(lines) + "\n"


def _filesystem(path: Path) -> str:
    """Type and device of the mount holding `path`, from /proc/mounts (Linux); "unknown" elsewhere."""
    try:
        best = ("", "unknown", "")
        target = str(path.resolve())
        with open("/proc/mounts") as fh:
            for line in fh:
                dev, mnt, fstype, *_ = line.split()
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
        return f"{best[1]} on {best[2]}" if best[0] else "unknown"
    except OSError:
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def build_methods(opts: BenchOptions) -> tuple[list[Method], list[MethodResult]]:
    """Available methods (ceiling first) and results for the ones that are absent."""
    methods: list[Method] = [ODirectMethod(opts.threads, opts.chunk_bytes)]
    absent: list[MethodResult] = []
    for name in opts.backends:
        methods.append(BackendMethod(name))
    for spec in opts.specs:
        methods.append(BackendMethod(str(spec.get("type")), spec=dict(spec)))
    if opts.fio:
        fio, why = find_fio()
        if fio is None:
            absent.append(MethodResult("fio", "peer", "absent", why))
        else:
            methods.append(fio)
    else:
        absent.append(MethodResult("fio", "peer", "absent", "not requested"))
    if opts.deepspeed:
        ds, why = find_deepspeed_aio()
        if ds is None:
            absent.append(MethodResult("DeepSpeed aio_handle", "peer", "absent", why))
        else:
            methods.append(ds)
    else:
        absent.append(
            MethodResult(
                "DeepSpeed aio_handle", "peer", "absent", "not requested (--quick or --no-deepspeed)"
            )
        )
    return methods, absent


def check_backends(opts: BenchOptions) -> None:
    """Every named backend and spec type is registered, before anything is written: an unknown
    name is a BackendNotFoundError with the nearest name, never a table cell after all rounds.
    (`tiered bench` calls this first; `run_bandwidth` itself reports any failure as a row.)"""
    from tiered.storage.registry import get_backend_class

    for name in opts.backends:
        get_backend_class(name)
    for spec in opts.specs:
        if not isinstance(spec, dict) or "type" not in spec:
            raise ConfigError(f"--spec {spec!r}: a backend spec is a JSON object with a 'type' key")
        get_backend_class(str(spec["type"]))


def _one_round(
    m: Method, src: torch.Tensor, dst: torch.Tensor, src_mv: memoryview, dst_mv: memoryview
) -> tuple[float, float]:
    c0 = time.process_time()
    write_s = m.write(src, src_mv)
    if not m.self_timed:
        # [Note: bandwidth methods]: a write counts once it is on the device.
        t0 = time.perf_counter()
        sync_files(m.files())
        write_s += time.perf_counter() - t0
    c1 = time.process_time()
    drop_cache(m.files())
    dst.zero_()
    c2 = time.process_time()
    read_s = m.read(dst, dst_mv)
    c3 = time.process_time()
    m.cpu_seconds = (c1 - c0, c3 - c2)
    if not m.self_timed and not torch.equal(dst, src):
        bad = int((dst != src).nonzero()[0]) if dst.numel() else 0
        raise StorageIOError(f"read back wrong bytes (first difference at byte {bad})")
    m.cleanup()
    return write_s, read_s


def run_bandwidth(opts: BenchOptions, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Measure every method round-robin. See [Note: round-robin measurement]."""
    say = progress or (lambda _msg: None)
    base = Path(opts.directory)
    if not base.is_dir():
        raise ConfigError(f"--dir {base}: not an existing directory; create it or pick the drive to measure")
    size = opts.aligned_size
    check_free_space(base, 2 * size, "one transfer at a time, written and kept until its read is checked")
    check_memory(size, [{"type": n} for n in opts.backends] + [dict(s) for s in opts.specs])
    workroot = Path(tempfile.mkdtemp(prefix="tiered-bench-", dir=base))
    methods, absent = build_methods(opts)
    src_mm, src = aligned_buffer(size)
    dst_mm, dst = aligned_buffer(size)
    gen = torch.Generator().manual_seed(1234)
    src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
    src_mv, dst_mv = memoryview(src_mm)[:size], memoryview(dst_mm)[:size]
    errors: dict[str, str] = {}
    samples: dict[str, tuple[list[float], list[float]]] = {}
    cpu: dict[str, tuple[list[float], list[float]]] = {}
    live: list[Method] = []
    try:
        for i, m in enumerate(methods):
            try:
                m.setup(workroot / f"m{i}", opts.op_timeout_s)
                live.append(m)
                samples[m.name] = ([], [])
            except (TieredError, OSError) as exc:
                errors[m.name] = f"{type(exc).__name__}: {exc}"
                log.warning("bench: %s unavailable: %s", m.name, exc)
        total = opts.warmup_rounds + opts.rounds
        add_total(progress, total * len(live))
        for r in range(total):
            k = r % max(1, len(live))
            for m in live[k:] + live[:k]:
                if m.name in errors:
                    continue
                try:
                    w, rd = _one_round(m, src, dst, src_mv, dst_mv)
                except (TieredError, OSError, RuntimeError, ValueError) as exc:
                    errors[m.name] = f"{type(exc).__name__}: {exc}"
                    log.warning("bench: %s failed in round %d: %s", m.name, r, exc)
                    continue
                if r >= opts.warmup_rounds:
                    samples[m.name][0].append(w)
                    samples[m.name][1].append(rd)
                    cw, cr = m.cpu_seconds
                    cpu.setdefault(m.name, ([], []))[0].append(cw)
                    cpu[m.name][1].append(cr)
                say(
                    f"round {r + 1}/{total} {'(warm-up) ' if r < opts.warmup_rounds else ''}{m.name}: "
                    f"write {size / w / 1e9:.2f} GB/s, read {size / rd / 1e9:.2f} GB/s"
                )
    finally:
        for m in methods:
            try:
                m.close()
            except Exception as exc:  # noqa: BLE001 - closing must not hide the measurement
                log.warning("bench: closing %s: %s", m.name, exc)
        remove_tree(workroot)
    results = _summarise(methods, samples, errors, size, cpu) + absent
    return BenchResult(
        size_bytes=size,
        directory=str(base),
        filesystem=_filesystem(base),
        rounds=opts.rounds,
        warmup_rounds=opts.warmup_rounds,
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine_info(),
        methods=tuple(results),
    )


def _summarise(
    methods: list[Method],
    samples: dict[str, tuple[list[float], list[float]]],
    errors: dict[str, str],
    size: int,
    cpu: dict[str, tuple[list[float], list[float]]] | None = None,
) -> list[MethodResult]:
    def gbps(ts: list[float]) -> float | None:
        return size / statistics.median(ts) / 1e9 if ts else None

    # The figures come from the seconds as reported (to the nanosecond), so a sweep's spread,
    # derived from those, always brackets its median even at 4 KiB (~10 us rounds), and the
    # ceiling's ratio to itself is exactly 1.
    samples = {k: ([round(x, 9) for x in ws], [round(x, 9) for x in rs]) for k, (ws, rs) in samples.items()}
    ceiling = methods[0]
    cw = gbps(samples.get(ceiling.name, ([], []))[0]) if ceiling.name not in errors else None
    cr = gbps(samples.get(ceiling.name, ([], []))[1]) if ceiling.name not in errors else None
    out = []
    for m in methods:
        if m.name in errors:
            out.append(MethodResult(m.name, m.kind, "error", errors[m.name]))
            continue
        ws, rs = samples[m.name]
        w, r = gbps(ws), gbps(rs)
        cws, crs = (cpu or {}).get(m.name, ([], []))

        def per_gb(ts: list[float]) -> float | None:
            return statistics.median(ts) / (size / 1e9) if ts else None

        cached = m is not ceiling and r is not None and cr is not None and r > CACHED_MARGIN * cr
        out.append(
            MethodResult(
                m.name,
                m.kind,
                "ok",
                "",
                tuple(ws),
                tuple(rs),
                w,
                r,
                w / cw if (w is not None and cw) else None,
                r / cr if (r is not None and cr) else None,
                per_gb(cws),
                per_gb(crs),
                cached,
            )
        )
    return out
