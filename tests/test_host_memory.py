"""glibc's mmap threshold fixed at initialize ([Note: host allocations and glibc's heap]): after
`tiered.initialize`, a large allocation is a mapping of its own (freed whole) even after a larger
chunk was freed, which under glibc's dynamic threshold would have moved it into the heap; the
config key turns it off, an environment's own MALLOC_MMAP_THRESHOLD_ wins, bad values name the key."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiered.config.loader import load_config
from tiered.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import ctypes, sys
sys.path.insert(0, {tests!r})
import torch, tiered
from engine_support import MLP, ds_config

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
config = ds_config(param="cpu", opt="cpu")
config["tiered"] = {{**config.get("tiered", {{}}), **{extra!r}}}
if {init!r}:
    tiered.initialize(MLP(), config).close()
big = libc.malloc(20 << 20)   # mapped (over the initial 128 KiB threshold) ...
libc.free(big)                # ... and freed: a dynamic threshold rises to 20 MiB
before = libc.mallinfo2().hblks
p = libc.malloc(4 << 20)
print("mapped", libc.mallinfo2().hblks - before)
libc.free(p)
"""


def _mapped(init: bool, extra: dict[str, object] | None = None, env: dict[str, str] | None = None) -> int:
    code = _PROBE.format(tests=str(Path(__file__).parent), init=init, extra=extra or {})
    full_env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")]
    )
    full_env.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=full_env
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return int(p.stdout.split("mapped")[-1])


glibc = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33 (mallinfo2)"
)


@glibc
def test_initialize_fixes_the_threshold_so_a_large_buffer_is_its_own_mapping() -> None:
    assert _mapped(init=False) == 0  # glibc's default: the 4 MiB now come from the heap
    assert _mapped(init=True) == 1


@glibc
def test_false_or_the_environment_s_own_setting_leaves_malloc_alone() -> None:
    assert _mapped(init=True, extra={"host_mmap_threshold": False}) == 0
    assert _mapped(init=True, env={"MALLOC_MMAP_THRESHOLD_": str(32 << 20)}) == 0
    assert _mapped(init=True, extra={"host_mmap_threshold": "8MiB"}) == 0  # 4 MiB is under it


def _tiered(value: object) -> object:
    return load_config(
        {"train_batch_size": 1, "tiered": {"host_mmap_threshold": value}}
    ).tiered.host_mmap_threshold


def test_the_key_takes_sizes_in_glibc_s_range_or_false() -> None:
    assert load_config({"train_batch_size": 1}).tiered.host_mmap_threshold == 1 << 20
    assert _tiered("2MiB") == 2 << 20 and _tiered(65536) == 65536
    assert _tiered(False) is None and _tiered(None) is None
    for bad in ("64MiB", 100, "lots", True):
        with pytest.raises(ConfigError, match="tiered.host_mmap_threshold"):
            _tiered(bad)
