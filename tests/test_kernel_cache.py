"""The native kernels' cache: one build folder per environment, found by every entry point, an
announced build, and the build lock ([Note: one kernel cache per environment], [Note: the build
lock] in tiered_ext/_cache.py). No test here compiles the real kernel: a compiler that fails at
once (CXX=/bin/false) or a stand-in for torch's load keep them to seconds."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tiered_ext import _cache, _loader

REPO = Path(__file__).resolve().parents[1]
_WHERE = "from tiered_ext import _loader; print(_loader.cpu_build()[1])"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "plugins")])
    return env


def _run(argv: list[str], env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_same_environment_same_key_different_environment_new_key(tmp_path: Path) -> None:
    env = _cache.BuildEnvironment.current(_loader.CSRC)
    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 1; }\n")
    key = _cache.build_key([src], ["-O3"], env)
    assert key == _cache.build_key([src], ["-O3"], _cache.BuildEnvironment.current(_loader.CSRC))
    for field, other in [
        ("python_prefix", "/elsewhere/venv"),
        ("torch_dir", "/elsewhere/site-packages/torch"),
        ("compiler", "/usr/bin/clang++ clang version 99"),
        ("source_dir", "/another/checkout/tiered_ext/csrc"),
    ]:
        assert _cache.build_key([src], ["-O3"], dataclasses.replace(env, **{field: other})) != key, field
    src.write_text("int f() { return 2; }\n")
    assert _cache.build_key([src], ["-O3"], env) != key  # a source change is a new build


def test_every_entry_point_finds_the_same_build_without_torch_extensions_dir(tmp_path: Path) -> None:
    """pytest (this process), `python -c`, `python -c` with some TORCH_EXTENSIONS_DIR, and the
    `tiered` CLI's interpreter all name one build folder."""
    here = _loader.cpu_build()[1]
    plain = {k: v for k, v in _env().items() if k != "TORCH_EXTENSIONS_DIR"}
    got = _run([sys.executable, "-c", _WHERE], plain).stdout.strip()
    other_dir = _run([sys.executable, "-c", _WHERE], dict(plain, TORCH_EXTENSIONS_DIR=str(tmp_path))).stdout
    assert got == str(here) == other_dir.strip()
    assert here.parent == _cache.cache_root() and here.name.startswith("cpu-")


def test_a_second_virtual_environment_gets_its_own_build(tmp_path: Path) -> None:
    """A venv that sees the same torch (a .pth onto this one's site-packages) is another
    environment: its build folder differs, so neither rebuilds the other's."""
    venv = tmp_path / "venv2"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(sysconfig.get_paths()["purelib"])
    py = venv / "bin" / "python"
    theirs = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], _env()
        ).stdout.strip()
    )
    (theirs / "main-site.pth").write_text(f"{purelib}\n")
    proc = _run([str(py), "-c", _WHERE], _env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).parent == _loader.cpu_build()[1].parent  # the same cache...
    assert proc.stdout.strip() != str(_loader.cpu_build()[1])  # ...another build in it


class _FakeModule(ModuleType):
    pass


def test_a_build_is_announced_before_and_after_and_a_cached_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv(_cache.CACHE_ENV, str(tmp_path))
    calls: list[str] = []

    def fake_load(*, name: str, build_directory: str, **kwargs: Any) -> ModuleType:
        calls.append(name)
        kwargs["extra_cflags"].append("-DADDED_BY_TORCH")  # as torch's load does to its lists
        (Path(build_directory) / f"{name}.so").write_bytes(b"")  # what a finished build leaves
        return _FakeModule(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    name = _loader.cpu_build()[0]
    with caplog.at_level(logging.WARNING, logger="tiered_ext"):
        _loader.load_extension("cpu", name, sources=[], extra_cflags=_loader.CPU_CFLAGS)
    assert _loader.cpu_build()[0] == name  # the build did not change what this process looks up
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("building tiered's CPU Adam kernel, once per environment, ~1-4 min")
    assert lines[1].startswith("built tiered's CPU Adam kernel in ")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiered_ext"):
        _loader.load_extension("cpu", name, sources=[], extra_cflags=_loader.CPU_CFLAGS)
    assert caplog.records == [] and calls == [name, name]  # loaded from the cache: nothing to say


def test_a_plain_python_run_shows_the_announcement(tmp_path: Path) -> None:
    """No logging set up (a user's script): the build still says so on stderr before it starts."""
    proc = _run(
        [sys.executable, "-c", "import tiered_ext; print(tiered_ext.kernel_info()['cpu_adam'])"],
        _env(CXX="/bin/false", **{_cache.CACHE_ENV: str(tmp_path)}),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "building tiered's CPU Adam kernel, once per environment, ~1-4 min" in proc.stderr
    assert proc.stdout.startswith("reference (build failed")


_STALE = textwrap.dedent(
    """
    import tiered_ext
    from tiered_ext import _loader
    where = _loader.cpu_build()[1]
    where.mkdir(parents=True)
    (where / "lock").write_text("")  # torch's lock, left by a build that was killed
    print(tiered_ext.kernel_info()["cpu_adam"])
    print("lock left:", (where / "lock").exists())
    """
)


def test_a_stale_torch_build_lock_is_removed_with_a_warning(tmp_path: Path) -> None:
    # Before: torch's FileBaton waited for this file forever, silently.
    proc = _run(
        [sys.executable, "-c", _STALE], _env(CXX="/bin/false", **{_cache.CACHE_ENV: str(tmp_path)}), 120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "removing the stale build lock" in proc.stderr and "is gone" in proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.splitlines()[0], "lock left: False"]


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tiered_ext._cache import build_lock
    where = Path(sys.argv[1])
    with build_lock(where, "the test kernel"):
        (where / "lock").write_text("")  # as torch does while it builds
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
        (where / "lock").unlink()
    """
)


def _hold(where: Path, seconds: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(where), str(seconds)],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_live_build_is_waited_for_naming_its_holder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = _hold(tmp_path / "b", 3)
    with (
        caplog.at_level(logging.WARNING, logger="tiered_ext"),
        _cache.build_lock(tmp_path / "b", "the test kernel"),
    ):
        assert not (tmp_path / "b" / "lock").exists()  # got the lock only once the holder was done
    holder.wait(timeout=30)
    text = caplog.text
    assert f"waiting for process {holder.pid} on " in text and "which builds the test kernel in" in text
    assert "removing the stale" not in text  # the holder cleaned up after itself


def test_a_killed_builders_lock_is_reclaimed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = _hold(tmp_path / "b", 600)
    holder.send_signal(signal.SIGKILL)  # killed mid-build: torch's lock stays behind
    holder.wait(timeout=30)
    assert (tmp_path / "b" / "lock").exists()
    with (
        caplog.at_level(logging.WARNING, logger="tiered_ext"),
        _cache.build_lock(tmp_path / "b", "the test kernel"),
    ):
        pass
    assert "waiting for" not in caplog.text  # the kernel dropped the dead process's flock
    assert "removing the stale build lock" in caplog.text
    assert not (tmp_path / "b" / "lock").exists()
    doc = json.loads((tmp_path / "b" / _cache.HOLDER_FILE).read_text())
    assert doc["pid"] == os.getpid()


def test_a_live_holder_that_never_finishes_is_a_timeout_naming_it(tmp_path: Path) -> None:
    # Before: the wait had no end; a builder stuck without dying stalled every later run silently.
    import time

    from tiered.errors import KernelBuildLockError

    holder = _hold(tmp_path / "b", 600)
    try:
        t0 = time.monotonic()
        with (
            pytest.raises(KernelBuildLockError) as ei,
            _cache.build_lock(tmp_path / "b", "the test kernel", 1.0),
        ):
            pass
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert took < 1.1 * 1.0 + 0.5, f"gave up after {took:.2f} s of a 1 s wait"
    msg = str(ei.value)
    assert f"process {holder.pid} on " in msg and _cache.WAIT_ENV in msg and "the test kernel" in msg, msg


def test_the_wait_comes_from_the_environment_and_a_bad_value_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(_cache.WAIT_ENV, "2.5")
    assert _cache.wait_limit_s() == 2.5
    monkeypatch.setenv(_cache.WAIT_ENV, "soon")
    with pytest.raises(ValueError, match=_cache.WAIT_ENV):
        _cache.wait_limit_s()
    monkeypatch.delenv(_cache.WAIT_ENV)
    assert _cache.wait_limit_s() == _cache.DEFAULT_WAIT_S


def test_a_lock_that_is_not_a_regular_file_is_refused_not_hung_on(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    os.mkfifo(tmp_path / "b" / _cache.HOLDER_FILE)
    with pytest.raises(OSError, match="is not a regular file"), _cache.build_lock(tmp_path / "b", "k"):
        pass


def test_tiered_build_ext_builds_ahead_and_says_so(tmp_path: Path) -> None:
    """`tiered build-ext` (what ./dev.sh set-up runs): the announcement, the status line, the
    cache folder; exit 1 when only the reference runs (here: a compiler that always fails)."""
    proc = _run(
        [sys.executable, "-m", "tiered.cli.main", "build-ext"],
        _env(CXX="/bin/false", **{_cache.CACHE_ENV: str(tmp_path)}),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "building tiered's CPU Adam kernel, once per environment, ~1-4 min" in proc.stderr
    assert "tiered_ext: cpu_adam=reference (build failed" in proc.stdout
    assert f"CPU Adam cache folder {tmp_path}" in proc.stdout
