"""Where a native kernel is built and cached, and the lock that keeps two builds apart.

[Note: one kernel cache per environment]
torch caches a JIT extension by name under TORCH_EXTENSIONS_DIR (default: a folder under the home
directory), and its build.ninja holds the include paths of the torch and Python that built it. So
two virtual environments, or two checkouts, sharing a name rebuild each other's build every time
one follows the other, and a TORCH_EXTENSIONS_DIR set by one entry point (dev.sh) and not by
another (the `tiered` script, `python -c`) builds the kernel twice. tiered therefore chooses the
build folder itself: `<cache>/<kind>-<key>`, where the key hashes everything the binary depends
on (`BuildEnvironment`: torch's install folder and version, the C++ compiler and its version, the
Python environment and version, the source folder) plus the sources' bytes and the flags. The
same environment finds the same build from every entry point, two environments never share one,
and editing a kernel or upgrading torch or the compiler builds afresh. `<cache>` is
TIERED_EXT_CACHE, else `$XDG_CACHE_HOME/tiered/ext`, else `~/.cache/tiered/ext`; TORCH_EXTENSIONS_DIR
is deliberately not consulted (a variable set in one shell only is what split the cache).

[Note: the build lock]
torch serialises builds of one folder with a `lock` file created with O_EXCL and removed when the
build ends; a process killed during the build leaves it behind and every later process waits for
it forever, silently. Around torch's build tiered holds an advisory flock(2) on
`tiered-build.lock` in the same folder, with the holder's pid, host and start time written in it.
The kernel drops a flock when its process dies, so: a process that gets the flock is the only
tiered builder of that folder, and a torch `lock` it finds is stale (its builder is gone) and is
removed with a WARNING; a process that does not get it logs who holds it and waits, at most
TIERED_EXT_BUILD_WAIT_S (default 30 min, a cold CUDA build takes a few), then raises
KernelBuildLockError naming the holder, and the kernel's loader falls back to the pure-torch
reference with a KernelBuildWarning: a builder that hangs without dying delays a run, never stops it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tiered.errors import KernelBuildLockError

log = logging.getLogger("tiered_ext")

CACHE_ENV = "TIERED_EXT_CACHE"
HOLDER_FILE = "tiered-build.lock"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder
# How often a waiting process repeats whom it waits for.
WAIT_REPORT_S = 60.0
WAIT_ENV = "TIERED_EXT_BUILD_WAIT_S"
DEFAULT_WAIT_S = 1800.0


def wait_limit_s() -> float:
    """How long to wait for another process's build ([Note: the build lock]): TIERED_EXT_BUILD_WAIT_S."""
    raw = os.environ.get(WAIT_ENV, "")
    if not raw:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected a number of seconds > 0, e.g. 1800")
    return value


def _compiler() -> str:
    """The C++ compiler torch's build uses (CXX, else c++), resolved, with its version line."""
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name) or name
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = (proc.stdout or proc.stderr).strip().splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    return f"{os.path.realpath(path) if os.path.exists(path) else path} {version[0] if version else '?'}"


@dataclass(frozen=True)
class BuildEnvironment:
    """What a native build depends on besides its sources and flags ([Note: one kernel cache
    per environment])."""

    torch_dir: str
    torch_version: str
    compiler: str
    python_prefix: str
    python_version: str
    source_dir: str

    @staticmethod
    def current(source_dir: Path) -> BuildEnvironment:
        return BuildEnvironment(
            torch_dir=str(Path(torch.__file__).resolve().parent),
            torch_version=f"{torch.__version__} {torch.version.git_version} cuda={torch.version.cuda}",
            compiler=_compiler(),
            python_prefix=str(Path(sys.prefix).resolve()),
            python_version=sys.version.split()[0],
            source_dir=str(source_dir.resolve()),
        )


def build_key(sources: Sequence[Path], flags: Sequence[str], env: BuildEnvironment) -> str:
    """16 hex digits over the sources' names and bytes, the flags and `env`."""
    h = hashlib.sha256()
    for path in sources:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(json.dumps(env.__dict__, sort_keys=True).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """The folder that holds every kernel build ([Note: one kernel cache per environment])."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tiered" / "ext"


def is_built(build_dir: Path, name: str) -> bool:
    """Whether `build_dir` already holds the linked module `name` (loading it then takes seconds)."""
    return any(build_dir.glob(f"{name}*.so"))


def _holder_text(path: Path) -> str:
    try:
        doc = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return "an unknown process"
    started = doc.get("started")
    since = f" (building for {time.time() - started:.0f} s)" if isinstance(started, (int, float)) else ""
    return f"process {doc.get('pid', '?')} on {doc.get('host', '?')}{since}"


@contextlib.contextmanager
def build_lock(build_dir: Path, what: str, wait_s: float | None = None) -> Iterator[None]:
    """Hold the build lock of `build_dir` ([Note: the build lock]): wait, naming the holder,
    while another live process builds there (at most `wait_s`, default `wait_limit_s()`, then
    KernelBuildLockError); remove torch's lock left by a dead one."""
    limit = wait_limit_s() if wait_s is None else wait_s
    build_dir.mkdir(parents=True, exist_ok=True)
    holder = build_dir / HOLDER_FILE
    # O_NONBLOCK: a FIFO planted under the name must not hang the open; it is then refused below.
    fd = os.open(holder, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{holder} is not a regular file; remove it (tiered writes its build lock there)")
        if st.st_uid != os.geteuid():
            raise OSError(
                f"{holder} belongs to uid {st.st_uid}, not this user: the kernel cache is shared with "
                f"another user; set {CACHE_ENV} to a folder of your own"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            start = waited = time.monotonic()
            log.warning(
                "tiered_ext: waiting for %s, which builds %s in %s", _holder_text(holder), what, build_dir
            )
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(min(0.2, max(0.0, start + limit - time.monotonic())))
                if time.monotonic() - start >= limit:
                    raise KernelBuildLockError(
                        f"{what}: {_holder_text(holder)} still holds the build lock {holder} after {limit:.3g} s "
                        f"({WAIT_ENV}); if that process is stuck, end it (the lock goes with it), or wait longer "
                        f"with a larger {WAIT_ENV}"
                    ) from None
                if time.monotonic() - waited > WAIT_REPORT_S:
                    waited = time.monotonic()
                    log.warning(
                        "tiered_ext: still waiting for %s, which builds %s", _holder_text(holder), what
                    )
        stale = build_dir / TORCH_LOCK
        if stale.exists() or stale.is_symlink():
            log.warning(
                "tiered_ext: removing the stale build lock %s (the process that built %s there is gone)",
                stale,
                what,
            )
            stale.unlink(missing_ok=True)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode(),
            0,
        )
        yield
    finally:
        os.close(fd)  # drops the flock
