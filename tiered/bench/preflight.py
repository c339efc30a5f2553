"""What `tiered bench` checks before it writes or allocates anything: free space on the drive,
host RAM and memory-tier capacity for the transfer size, and whether the drive takes O_DIRECT.

Each failure is a ConfigError naming the flag, the bytes needed and the bytes there (the CLI
exits 2 with it); a drive that refuses O_DIRECT is not an error (tmpfs, some FUSE and network
file systems): the ceiling then runs buffered, said once in the log and in its row's name.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tiered.errors import ConfigError
from tiered.units import format_bytes

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_free_space(path: Path, need: int, why: str) -> None:
    """ConfigError before anything is written when `path`'s file system (the nearest existing
    parent of `path`) has less than `need` bytes free."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = free_bytes(probe)
    if free < need:
        raise ConfigError(
            f"--dir {path}: {format_bytes(free)} free, the benchmark needs about {format_bytes(need)} "
            f"({need} bytes: {why}); pass a smaller --size (or model) or free space"
        )


def available_ram_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping); None elsewhere."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_backend(spec: dict[str, Any]) -> tuple[str, int | None] | None:
    """(device, free bytes) of a memory-like backend spec; None for a storage backend. Only
    backends that declare no static capabilities, or memory-like ones, are opened to ask."""
    from tiered.storage.registry import get_backend_class, open_backend

    try:
        caps = getattr(get_backend_class(str(spec["type"])), "static_capabilities", None)
        if caps is not None and not caps.memory_like:
            return None
        backend = open_backend(dict(spec))
    except Exception:  # noqa: BLE001 - unknown, or needs options it was not given: the run reports it
        return None
    try:
        c = backend.capabilities
        return (str(c.device), backend.capacity().free_bytes) if c.memory_like else None
    finally:
        asyncio.run(backend.close())


def check_memory(size: int, specs: Iterable[dict[str, Any]], *, buffers: int = 2) -> None:
    """ConfigError when `size` does not fit: the benchmark holds `buffers` host buffers of it,
    and each memory-like backend one more copy in its own memory (host RAM for "cpu", device
    memory for a CUDA "gpu"), which must not exceed what that memory has free."""
    host_tiers: list[str] = []
    for spec in specs:
        found = _memory_backend(spec)
        if found is None:
            continue
        device, free = found
        name = str(spec["type"])
        if device == "cpu":
            host_tiers.append(name)
        elif free is not None and size > free:
            raise ConfigError(
                f"--size {format_bytes(size, binary=True)}: larger than the {format_bytes(free)} free in "
                f"memory tier {name!r} ({device}); pass a smaller --size"
            )
    need = size * (buffers + len(host_tiers))
    ram = available_ram_bytes()
    if ram is not None and need > ram:
        held = f"{buffers} buffers" + (
            f" + one copy in memory tier {', '.join(host_tiers)}" if host_tiers else ""
        )
        raise ConfigError(
            f"--size {format_bytes(size, binary=True)}: the benchmark holds {held} of it in host RAM, "
            f"{format_bytes(need)} ({need} bytes), but only {format_bytes(ram)} is available; pass a "
            "smaller --size"
        )


def direct_io_supported(directory: Path) -> tuple[bool, str]:
    """Whether files in `directory` open with O_DIRECT (a probe file, removed); and why not."""
    if not _O_DIRECT:
        return False, "this platform has no O_DIRECT"
    probe = directory / ".tiered-bench-direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return False, f"the file system refuses O_DIRECT ({os.strerror(exc.errno)})"
        raise
    else:
        os.close(fd)
        return True, ""
    finally:
        try:
            probe.unlink()
        except FileNotFoundError:
            pass
