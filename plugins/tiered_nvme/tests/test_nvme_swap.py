"""[Note: nvme swap directories]: swap backends clean up after themselves and after dead processes."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiered_nvme import NVMeBackend
from tiered_nvme.swap import LOCK_NAME, SWAP_PREFIX, host_tag
from tiered_nvme.swapstore import SLAB_FILE

from tiered.storage import open_backend
from tiered.testing import BackendConformance, random_bytes


class TestNVMeSwapConformance(BackendConformance):
    """The engine's offload configuration: in place, unsynced, in a private swap directory."""

    atomic_writes = False  # in-place overwrites: same-key bursts are not promised whole

    def make_backend(self, tmp_path):
        return NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True)

    @pytest.mark.parametrize("delay_s", [0.0, 0.02])
    def test_cancelled_write_leaves_no_partial_object(self, tmp_path: Path, delay_s: float) -> None:
        # In-place writes do not promise this ([Note: nvme scratch mode]); what they promise after
        # a cancel: the backend still works and the next write rewrites the file whole.
        async def scenario(b) -> None:
            await b.write("victim", random_bytes(8 << 20, seed=7))
            task = asyncio.ensure_future(b.write("victim", random_bytes(8 << 20, seed=8)))
            await asyncio.sleep(delay_s)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.roundtrip(b, "victim", random_bytes(100, seed=9))
            # 100 B is a slab object ([Note: nvme slab coalescing]): the 8 MiB file went with it
            assert not (b.directory / "victim").exists()

        self.run(tmp_path, scenario)


def _run(coro):
    return asyncio.run(coro)


async def _fill(b: NVMeBackend, n: int = 3) -> None:
    for i in range(n):
        await b.write(f"k{i}", random_bytes((1 << 20) + i, seed=i))


def _swap_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith(SWAP_PREFIX))


def _dead_pid() -> int:
    """A pid no process has: one past the kernel's largest."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _fake_swap_dir(parent: Path, pid: int, *, host: str | None = None, lock: bool = True) -> Path:
    """A swap directory as a process that died left it: a key file, a temp file, an unheld lock."""
    d = parent / f"{SWAP_PREFIX}{host or host_tag()}-{pid}-ab12_cd"
    d.mkdir()
    (d / "w0").write_bytes(b"x" * 5000)
    (d / "w1~tmp-0123456789ab").write_bytes(b"y" * 1000)
    if lock:
        (d / LOCK_NAME).touch()
    return d


def test_swap_files_are_deleted_on_close(tmp_path: Path) -> None:
    b = NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True)
    assert b.directory.parent == tmp_path.resolve() and b.directory.name.startswith(SWAP_PREFIX)
    assert b.capabilities.persistent is False and b.spec()["swap"] is True

    async def go() -> None:
        await _fill(b)
        # k0 (1 MiB) is a slab object, k1 and k2 files of their own ([Note: nvme slab coalescing])
        assert {p.name for p in b.directory.iterdir()} == {SLAB_FILE, "k1", "k2", LOCK_NAME}
        await b.close()
        await b.close()  # idempotent

    _run(go())
    assert list(tmp_path.iterdir()) == [], "swap files or the swap directory were left behind"


def test_persistent_backend_keeps_its_files_after_close(tmp_path: Path) -> None:
    async def go() -> None:
        b = NVMeBackend(tmp_path)  # atomic, no swap: a user's own tier
        assert b.directory == tmp_path.resolve() and b.capabilities.persistent
        await _fill(b)
        await b.close()
        again = NVMeBackend(tmp_path)
        out = torch.empty((1 << 20) + 1, dtype=torch.uint8)
        await again.read("k1", out)
        assert torch.equal(out, random_bytes((1 << 20) + 1, seed=1))
        await again.close()

    _run(go())
    assert {p.name for p in tmp_path.iterdir()} == {"k0", "k1", "k2"}


def test_stale_swap_directories_are_reclaimed_and_live_ones_kept(tmp_path: Path, caplog) -> None:
    dead = _fake_swap_dir(tmp_path, _dead_pid())
    dead_unlocked = _fake_swap_dir(tmp_path, _dead_pid() + 1, lock=False)  # died before locking
    live_unlocked = _fake_swap_dir(tmp_path, os.getpid(), lock=False)  # may be locking right now
    other_host = _fake_swap_dir(tmp_path, _dead_pid(), host=f"not-{host_tag()}")  # its pids are not ours
    held = _fake_swap_dir(tmp_path, _dead_pid() + 2)  # pid reused or not: the held lock decides
    user_files = {"checkpoint.pt": b"c" * 300, "w0~tmp-0123456789ab": b"t" * 300}  # a persistent tier's
    for name, data in user_files.items():
        (tmp_path / name).write_bytes(data)
    fd = os.open(held / LOCK_NAME, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with caplog.at_level(logging.INFO, logger="tiered_nvme.backend"):
            b = NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True)
        _run(b.close())
    finally:
        os.close(fd)
    assert not dead.exists() and not dead_unlocked.exists()
    assert live_unlocked.exists() and other_host.exists() and held.exists()
    assert all((tmp_path / n).read_bytes() == d for n, d in user_files.items())
    lines = [r.getMessage() for r in caplog.records if "stale swap" in r.getMessage()]
    assert len(lines) == 1, lines
    assert all(r.levelno == logging.WARNING for r in caplog.records if "stale swap" in r.getMessage())
    assert "removed 2 stale swap directories" in lines[0] and "12000 bytes" in lines[0]
    assert dead.name in lines[0] and dead_unlocked.name in lines[0] and str(tmp_path) in lines[0]


def test_a_second_backend_in_this_process_keeps_the_first_ones_files(tmp_path: Path) -> None:
    async def go() -> None:
        first = NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True)
        await _fill(first)
        second = open_backend(first.spec())  # same path, same pid: the lock tells them apart
        assert second.directory != first.directory
        out = torch.empty((1 << 20) + 2, dtype=torch.uint8)
        await first.read("k2", out)
        assert torch.equal(out, random_bytes((1 << 20) + 2, seed=2))
        await second.close()
        await first.close()

    _run(go())
    assert list(tmp_path.iterdir()) == []


_CHILD = textwrap.dedent("""
    import asyncio, os, sys
    import torch
    from tiered_nvme import NVMeBackend

    async def main():
        b = NVMeBackend(sys.argv[1], atomic=False, fsync=False, swap=True)
        await b.write("w", torch.ones(3 << 20, dtype=torch.uint8))
        print(b.directory, flush=True)
        if sys.argv[2] == "crash":
            os._exit(1)  # no close(): what a killed or crashed training run leaves
        sys.stdin.readline()  # stay alive, lock held, until the parent says so
        await b.close()

    asyncio.run(main())
""")


def test_a_crashed_process_leftovers_are_reclaimed_but_a_live_process_is_not(tmp_path: Path) -> None:
    def child(mode: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    crashed = child("crash")
    crashed_dir = Path(crashed.stdout.readline().strip())
    assert crashed.wait(timeout=120) == 1 and (crashed_dir / "w").stat().st_size >= 3 << 20  # + shift
    alive = child("live")
    try:
        alive_dir = Path(alive.stdout.readline().strip())
        assert alive_dir.is_dir() and not crashed_dir.exists(), "the live child reclaims the crashed one's"
        b = NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True)
        assert (alive_dir / "w").stat().st_size >= 3 << 20, "a live process's swap files were removed"
        _run(b.close())
    finally:
        alive.communicate("done\n", timeout=120)
    assert alive.returncode == 0 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("atomic", [True, False])
def test_swap_directory_is_removed_when_open_fails(tmp_path: Path, monkeypatch, atomic: bool) -> None:
    import errno

    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if "tiered-probe" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(OSError, match="not writable"):
        NVMeBackend(tmp_path, atomic=atomic, swap=True)
    assert list(tmp_path.iterdir()) == []


def _unblock_fifo(path: Path) -> None:
    """Open the write end of FIFO `path` (and close it), so a reader blocked opening it returns."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_named_lock_in_a_stale_looking_swap_directory_is_left_alone_without_blocking(
    tmp_path: Path, caplog
) -> None:
    # anyone who can write into a shared nvme_path can plant this: opening it for reading blocks
    # until a writer comes, so before the fix every run on that path hung in its first open
    import threading

    trap = tmp_path / f"{SWAP_PREFIX}{host_tag()}-{_dead_pid()}-ab12_cd"
    trap.mkdir()
    os.mkfifo(trap / LOCK_NAME)
    dead = _fake_swap_dir(tmp_path, _dead_pid() + 1)  # a real leftover beside it is still reclaimed
    made: list[NVMeBackend] = []
    t = threading.Thread(
        target=lambda: made.append(NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True))
    )
    with caplog.at_level(logging.WARNING, logger="tiered_nvme"):
        t.start()
        t.join(15)
        blocked = t.is_alive()
        if blocked:
            _unblock_fifo(trap / LOCK_NAME)
            t.join(15)
    assert not blocked, "opening a swap backend blocked on a FIFO named 'lock'"
    _run(made[0].close())
    assert trap.is_dir() and stat.S_ISFIFO(os.lstat(trap / LOCK_NAME).st_mode)  # kept, not opened
    assert not dead.exists()
    warned = [r.getMessage() for r in caplog.records if str(trap / LOCK_NAME) in r.getMessage()]
    assert warned and "not a lock file this user wrote" in warned[0], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("numel", [1 << 20, 64], ids=["own-file", "in-the-slab"])
def test_a_truncated_swap_file_is_corruption_not_retried_and_says_what_to_do(
    tmp_path: Path, caplog, numel: int
) -> None:
    from tiered.errors import StorageCorruptError
    from tiered.tiers import Tier, TierManager

    nv = NVMeBackend(tmp_path, atomic=False, fsync=False, swap=True)
    with TierManager([Tier("cpu", open_backend({"type": "cpu"})), Tier("nvme", nv)], timeout_s=30) as m:
        p = m.create("p", numel, torch.float32, "nvme", init=torch.ones(numel))
        victim = nv.directory / (SLAB_FILE if numel == 64 else "p")
        assert victim.is_file()
        os.truncate(victim, 0)
        with caplog.at_level(logging.WARNING), pytest.raises(StorageCorruptError) as ei:
            m.fetch(p, "cpu").result()
    msg = str(ei.value)
    assert "partition 'p'" in msg and str(victim) in msg and "ended early" in msg
    assert "restore the training state from a checkpoint" in msg
    assert not [r for r in caplog.records if "transient error, retry" in r.getMessage()], (
        "retried as transient"
    )
