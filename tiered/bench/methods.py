"""The ways `tiered bench` moves one buffer to a file and back: backends, a ceiling and peers.

[Note: bandwidth methods]
Every method writes the same page-aligned source buffer to its own file(s) and reads it back
into the same page-aligned destination buffer, so they differ only in how they move the bytes:

* the ceiling: a plain O_DIRECT copy, `threads` threads issuing os.pwritev / os.preadv on
  `chunk_bytes` pieces (8 x 8 MiB by default; on this machine kind it beats fio and DeepSpeed's
  aio, see benchmarks/RESULTS.md), then fsync;
* tiered's storage backends, opened *only* through `tiered.open_backend` (the same door a user
  has): nvme, aiofiles, tensorstore;
* peers when present: fio (libaio, O_DIRECT, bs 8 MiB, iodepth 8, --end_fsync=1; fio's own
  bandwidth figure, which excludes its process start-up) and DeepSpeed's aio handle (sync_pwrite
  / sync_pread, block 1 MiB, queue depth 32).

`write`/`read` return elapsed seconds: the runner times everything else (cache dropping, checks)
outside those calls. A method whose write is not durable by itself is made durable by the
runner's fsync of its files inside the write timing (`self_timed` methods excepted), so every
write figure means "on the device".
"""

from __future__ import annotations

import abc
import asyncio
import importlib.metadata
import json
import logging
import mmap
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tiered.errors import StorageIOError, TierTimeoutError

log = logging.getLogger(__name__)

MIB = 1 << 20
ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A page-aligned anonymous mapping and a uint8 tensor over it (no copy). Keep both alive."""
    mm = mmap.mmap(-1, max(nbytes, ALIGN))
    return mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def sync_files(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(paths: list[Path]) -> None:
    """Cold read: flush, then posix_fadvise(DONTNEED) each file (dirty pages cannot be dropped)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_chunk(fd: int, mv: memoryview, off: int, n: int, base: int = 0) -> None:
    """Write `mv[off : off + n]` to `fd` at file offset `base + off` (`mv` starts at file offset
    `base`), retrying short writes: one chunk of the ceiling's O_DIRECT copy (so `mv`, `off`, `n`
    and `base` must keep O_DIRECT's alignment when `fd` was opened with it). Safe to run on several
    threads at once on disjoint chunks."""
    done = 0
    while done < n:
        done += os.pwritev(fd, [mv[off + done : off + n]], base + off + done)


def read_chunk(fd: int, mv: memoryview, off: int, n: int, base: int = 0) -> None:
    """Read file bytes `base + off .. base + off + n` of `fd` into `mv[off : off + n]`, retrying
    short reads; the counterpart of `write_chunk`. Raises StorageIOError when the file ends first."""
    done = 0
    while done < n:
        got = os.preadv(fd, [mv[off + done : off + n]], base + off + done)
        if got == 0:
            raise StorageIOError(f"short read at offset {base + off + done}: file ended early")
        done += got


def remove_tree(path: Path, attempts: int = 50) -> None:
    """Remove `path` and everything under it. An I/O worker thread an interrupt left running may
    still finish a file inside while the tree is being removed (rmtree then finds a folder not
    empty): retry briefly, and say so if it still stands."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.02)
    log.warning("bench: could not remove %s; remove it by hand", path)


class Method(abc.ABC):
    """One way of moving the buffer. See [Note: bandwidth methods]."""

    name: str = "?"
    kind: str = "backend"
    """"ceiling", "backend" or "peer"."""
    self_timed: bool = False

    def __init__(self) -> None:
        self.workdir: Path | None = None
        self.timeout_s = 600.0
        self.cpu_seconds: tuple[float, float] = (0.0, 0.0)
        """Process CPU time of the last timed write and read (set by the runner)."""

    def setup(self, workdir: Path, timeout_s: float) -> None:
        self.workdir = workdir
        self.timeout_s = timeout_s
        workdir.mkdir(parents=True, exist_ok=True)

    @abc.abstractmethod
    def write(self, src: torch.Tensor, mv: memoryview) -> float: ...

    @abc.abstractmethod
    def read(self, dst: torch.Tensor, mv: memoryview) -> float: ...

    def files(self) -> list[Path]:
        assert self.workdir is not None
        return files_under(self.workdir)

    def cleanup(self) -> None:
        """Remove this round's file(s) so the next round writes afresh."""
        for p in self.files():
            p.unlink(missing_ok=True)

    def close(self) -> None:
        if self.workdir is not None:
            remove_tree(self.workdir)


class ODirectMethod(Method):
    """The ceiling: an O_DIRECT pwritev/preadv thread pool."""

    kind = "ceiling"

    def __init__(self, threads: int = 8, chunk_bytes: int = 8 * MIB) -> None:
        super().__init__()
        self.threads, self.chunk = threads, chunk_bytes
        self.name = f"O_DIRECT pwritev/preadv {threads} threads x {chunk_bytes // MIB} MiB"
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-odirect")
        self.direct = _O_DIRECT != 0
        self.base_name = self.name

    def setup(self, workdir: Path, timeout_s: float) -> None:
        super().setup(workdir, timeout_s)
        # decided once, before any round: the row's name (the key of its samples) never changes
        from tiered.bench.preflight import direct_io_supported

        self.direct, why = direct_io_supported(workdir)
        self.name = self.base_name if self.direct else f"{self.base_name} (O_DIRECT refused: buffered)"
        if not self.direct:
            warn_buffered_once(workdir.parent, why)

    @property
    def path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "odirect.bin"

    def _open(self, flags: int) -> int:
        return os.open(self.path, flags | (_O_DIRECT if self.direct else 0), 0o644)

    def _run(self, fd: int, mv: memoryview, op: Any) -> None:
        n = len(mv)
        futures = [
            self.pool.submit(op, fd, mv, off, min(self.chunk, n - off)) for off in range(0, n, self.chunk)
        ]
        deadline = time.monotonic() + self.timeout_s
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise TierTimeoutError(
                    f"bench {self.name}: I/O on {self.path} took over {self.timeout_s:.0f} s"
                ) from exc

    def write(self, src: torch.Tensor, mv: memoryview) -> float:
        t0 = time.perf_counter()
        fd = self._open(os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            self._run(fd, mv, write_chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def read(self, dst: torch.Tensor, mv: memoryview) -> float:
        t0 = time.perf_counter()
        fd = self._open(os.O_RDONLY)
        try:
            self._run(fd, mv, read_chunk)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        super().close()


_WARNED: set[str] = set()


def warn_buffered_once(directory: Path, why: str) -> None:
    """The O_DIRECT fallback, said once per directory (a sweep sets up the ceiling per size)."""
    key = str(directory.resolve().parent)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "bench: %s: %s; the ceiling runs buffered (page cache), so ratios to it are not to the "
            "device; measure a drive that takes O_DIRECT for a real ceiling",
            directory.parent,
            why,
        )


def backend_spec(backend_type: str, directory: Path) -> dict[str, Any]:
    """The open_backend spec that puts `backend_type`'s files in `directory`.

    tensorstore takes a kvstore spec (its "file" driver here); a backend whose constructor takes
    "path" gets `directory`, one that takes "paths" (striping) two subdirectories of it, and any
    other registered backend is opened bare (``{"type": name}``): the bench never invents an
    option a backend does not accept.
    """
    if backend_type == "tensorstore":
        return {"type": "tensorstore", "kvstore": {"driver": "file", "path": f"{directory}/"}}
    from tiered.storage.registry import _constructor_params, get_backend_class

    accepted, _required, _var_kw = _constructor_params(get_backend_class(backend_type))
    if "path" in accepted:
        return {"type": backend_type, "path": str(directory)}
    if "paths" in accepted:
        return {"type": backend_type, "paths": [str(directory / "s0"), str(directory / "s1")]}
    return {"type": backend_type}


def _short(spec: dict[str, Any]) -> str:
    text = json.dumps(spec, separators=(",", ":"))
    return text if len(text) <= 60 else text[:57] + "..."


class BackendMethod(Method):
    """A tiered storage backend, opened by spec through tiered.open_backend."""

    KEY = "bench.payload"

    def __init__(self, backend_type: str, *, spec: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        self.backend_type, self.options = backend_type, options
        self.spec = spec
        """A full user spec (``--spec``): opened as given, its own paths kept."""
        self.name = f"tiered backend: {backend_type}" if spec is None else f"tiered spec: {_short(spec)}"
        self.backend: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def setup(self, workdir: Path, timeout_s: float) -> None:
        super().setup(workdir, timeout_s)
        from tiered.storage.registry import open_backend

        spec = (
            self.spec
            if self.spec is not None
            else {**backend_spec(self.backend_type, workdir), **self.options}
        )
        self.backend = open_backend(spec)
        self.loop = asyncio.new_event_loop()

    def _await(self, coro: Any, what: str) -> None:
        assert self.loop is not None
        try:
            self.loop.run_until_complete(asyncio.wait_for(coro, self.timeout_s))
        except asyncio.TimeoutError as exc:
            raise TierTimeoutError(
                f"bench: backend {self.backend_type!r} {what} of {self.KEY!r} took over {self.timeout_s:.0f} s"
            ) from exc

    def write(self, src: torch.Tensor, mv: memoryview) -> float:
        t0 = time.perf_counter()
        self._await(self.backend.write(self.KEY, src), "write")
        return time.perf_counter() - t0

    def read(self, dst: torch.Tensor, mv: memoryview) -> float:
        t0 = time.perf_counter()
        self._await(self.backend.read(self.KEY, dst), "read")
        return time.perf_counter() - t0

    def cleanup(self) -> None:
        self._await(self.backend.delete(self.KEY), "delete")

    def close(self) -> None:
        if self.backend is not None and self.loop is not None:
            try:
                # a Ctrl-C inside run_until_complete leaves the interrupted write or read pending
                # on this loop: running the loop again (exists, delete) would resume it, and it
                # could write its file after the delete and the folder's removal. Cancel it first.
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                # a --spec backend writes outside the bench's folder: its object goes too (Ctrl-C too)
                if self.loop.run_until_complete(self.backend.exists(self.KEY)):
                    self._await(self.backend.delete(self.KEY), "delete")
                self._await(self.backend.close(), "close")
            finally:
                self.loop.close()
        super().close()


class FioMethod(Method):
    """fio, sequential O_DIRECT, bandwidth as fio reports it."""

    kind = "peer"
    self_timed = True

    def __init__(self, binary: str, ioengine: str = "libaio", bs: str = "8M", iodepth: int = 8) -> None:
        super().__init__()
        self.binary, self.ioengine, self.bs, self.iodepth = binary, ioengine, bs, iodepth
        self.name = f"fio {ioengine} bs={bs} iodepth={iodepth} direct=1 (fio-reported)"

    def _fio(self, rw: str, size: int) -> float:
        assert self.workdir is not None
        cmd = [
            self.binary,
            "--name=seq",
            f"--filename={self.workdir / 'fio.dat'}",
            f"--size={size}",
            f"--rw={rw}",
            f"--bs={self.bs}",
            "--direct=1",
            f"--ioengine={self.ioengine}",
            f"--iodepth={self.iodepth}",
            "--numjobs=1",
            "--output-format=json",
        ] + (["--end_fsync=1"] if rw == "write" else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise TierTimeoutError(f"bench: fio {rw} took over {self.timeout_s:.0f} s") from exc
        if proc.returncode != 0:
            raise StorageIOError(f"fio {rw} failed (exit {proc.returncode}): {proc.stderr.strip()[:300]}")
        # fio may print warnings before the JSON document.
        report = json.loads(proc.stdout[proc.stdout.index("{") :])
        bw = float(report["jobs"][0][rw]["bw_bytes"])
        if not bw:
            raise StorageIOError(f"fio {rw} reported 0 bytes/s: {proc.stdout[:300]}")
        return size / bw

    def write(self, src: torch.Tensor, mv: memoryview) -> float:
        return self._fio("write", len(mv))

    def read(self, dst: torch.Tensor, mv: memoryview) -> float:
        return self._fio("read", len(mv))


class DeepSpeedAioMethod(Method):
    """DeepSpeed's aio_handle (libaio), the I/O under ZeRO-Infinity."""

    kind = "peer"

    def __init__(self, handle: Any, block_size: int = MIB, queue_depth: int = 32) -> None:
        super().__init__()
        self.handle = handle
        self.name = f"DeepSpeed aio_handle block={block_size // MIB} MiB qd={queue_depth}"

    @property
    def path(self) -> str:
        assert self.workdir is not None
        return str(self.workdir / "deepspeed.bin")

    def write(self, src: torch.Tensor, mv: memoryview) -> float:
        t0 = time.perf_counter()
        if self.handle.sync_pwrite(src, self.path) < 0:
            raise StorageIOError(f"DeepSpeed aio sync_pwrite to {self.path} failed")
        return time.perf_counter() - t0

    def read(self, dst: torch.Tensor, mv: memoryview) -> float:
        t0 = time.perf_counter()
        if self.handle.sync_pread(dst, self.path) < 0:
            raise StorageIOError(f"DeepSpeed aio sync_pread from {self.path} failed")
        return time.perf_counter() - t0


def find_fio() -> tuple[FioMethod | None, str]:
    binary = shutil.which("fio")
    if binary is None:
        return None, "absent (no `fio` on PATH)"
    return FioMethod(binary), "present"


def find_deepspeed_aio(block_size: int = MIB, queue_depth: int = 32) -> tuple[DeepSpeedAioMethod | None, str]:
    """DeepSpeed's aio handle if deepspeed imports and its async_io op builds; else why not."""
    try:  # DeepSpeed's own distribution: `deepspeed` may be tiered's alias in this process
        importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None, "absent (deepspeed not installed)"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "absent (deepspeed's async_io op is not compatible here: libaio missing?)"
        not_ready = _deepspeed_aio_not_ready()
        if not_ready:
            return None, f"absent ({not_ready})"
        lib = builder.load(verbose=False)
        # block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism
        handle = lib.aio_handle(block_size, queue_depth, False, True, 1)
    except Exception as exc:  # noqa: BLE001 - any failure means "not available", reported as such
        return None, f"absent ({type(exc).__name__}: {str(exc)[:200]})"
    return DeepSpeedAioMethod(handle, block_size, queue_depth), "present"


_DS_BUILD_HINT = "build it once with: python -c 'from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()'"


def _deepspeed_aio_not_ready() -> str:
    """Why loading DeepSpeed's async_io now could block, or "" when it loads at once.

    A just-in-time build takes minutes and waits forever on a lock a killed build left behind;
    the benchmark only uses an op that is pre-installed or already built (nothing hangs).
    """
    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("async_io"):
            return ""
    except ImportError:
        pass
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory("async_io", verbose=False))
    if (build_dir / "lock").exists():
        return f"a build lock exists at {build_dir / 'lock'}: a build is running, or a killed one left it (remove it then)"
    if not (build_dir / "async_io.so").exists():
        return f"DeepSpeed's async_io op is not built yet; {_DS_BUILD_HINT}"
    return ""
