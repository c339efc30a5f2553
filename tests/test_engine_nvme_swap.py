"""engine.close() leaves nothing of the offload swap files on nvme_path, and keeps a user's own tier.

See the nvme backend's [Note: nvme swap directories] and tiered.config.tiers [Note: default tiers].
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_support import MLP, ds_config

import tiered
from tiered.config import load_config
from tiered.engine.build import build_tier_manager


def _train(engine, steps: int = 2) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        engine.backward(engine(x=torch.randn(4, 16, generator=g), y=torch.randn(4, 8, generator=g)))
        engine.step()


def test_close_removes_the_offload_swap_files(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    torch.manual_seed(0)
    with tiered.initialize(MLP(), ds_config(param="nvme", opt="nvme", nvme_path=str(nvme))) as engine:
        _train(engine)
        (swap,) = nvme.iterdir()  # one private directory per backend, all files inside it
        assert swap.name.startswith("tiered-swap-") and len(list(swap.iterdir())) > 1
    assert list(nvme.iterdir()) == [], "engine.close() left swap files on nvme_path"


def test_parsing_creates_no_folder_and_the_engine_creates_it_once_opened(tmp_path: Path) -> None:
    """[Note: config parsing is pure]: reading a config that names nvme paths two levels deep
    writes nothing (parsing made them, so a refused or merely weighed config left folders behind);
    the engine's nvme tiers create them when they open."""
    params, opt = tmp_path / "a" / "params", tmp_path / "b" / "opt"
    raw = ds_config(param="nvme", opt="nvme", nvme_path=str(params), mkdir=False)
    raw["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(opt)
    cfg = load_config(raw, model=MLP())
    assert list(tmp_path.iterdir()) == [], "parsing the config wrote to disk"
    assert cfg.tiered.tiers["nvme"].backend["create"] is True
    torch.manual_seed(0)
    with tiered.initialize(MLP(), raw) as engine:
        _train(engine, 1)
        assert params.is_dir() and opt.is_dir()
    assert list(params.iterdir()) == [] and list(opt.iterdir()) == []


def test_tier_manager_close_keeps_a_user_declared_tier_and_drops_the_swap_tier(tmp_path: Path) -> None:
    # Through the TierManager the engine builds: (engine.initialize does not yet route state to a
    # custom tier named by tiered.optimizer_tier, so the manager is driven directly.)
    nvme, disk = tmp_path / "nvme", tmp_path / "disk"
    disk.mkdir()
    cfg = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
            },
            "tiered": {"tiers": {"disk": {"backend": {"type": "nvme", "path": str(disk)}}}},
        }
    )
    tm = build_tier_manager(cfg)
    with tm:
        for home in ("nvme", "disk"):
            tm.create(f"{home}0", 4096, torch.float32, home, init=torch.ones(4096))
        tm.flush().result()
        (swap,) = nvme.iterdir()
        # 16 KiB is a slab object of the swap tier (tiered_nvme [Note: nvme slab coalescing])
        assert (swap / "~slab").stat().st_size >= 16384 and (disk / "disk0").is_file()
    assert list(nvme.iterdir()) == [], "closing the manager left the swap tier's files"
    assert [p.name for p in disk.iterdir()] == ["disk0"], "a persistent tier lost its files at close"


_NO_CLOSE = """
import sys
sys.path.insert(0, {tests!r})
import torch, tiered
from engine_support import MLP, ds_config
engine = tiered.initialize(MLP(), ds_config(param={dev!r}, opt={dev!r}, nvme_path={nvme!r}))
engine.backward(engine(x=torch.randn(4, 16), y=torch.randn(4, 8)))
engine.step()
print("trained", flush=True)
"""


@pytest.mark.parametrize("dev", ["none", "nvme"])
def test_a_script_that_never_closes_exits_promptly_and_leaves_no_swap(tmp_path: Path, dev: str) -> None:
    # [Note: managers left open at exit]: this used to wait out a 60 s close timeout (and, with
    # NVMe, abort in C++ teardown), leaving the swap folder behind
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    code = _NO_CLOSE.format(tests=str(Path(__file__).parent), dev=dev, nvme=str(nvme))
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=40,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "trained" in p.stdout
    assert "did not finish cleanly" not in p.stderr
    assert list(nvme.iterdir()) == []


def test_a_fifo_named_lock_in_a_stale_swap_folder_does_not_hang_initialize(tmp_path: Path) -> None:
    # anyone who can write into a shared nvme_path can plant this; opening it for reading blocks
    # until a writer comes. Run in a thread, unblocked on failure, so a regression cannot hang the suite
    import threading

    from tiered_nvme.swap import LOCK_NAME, SWAP_PREFIX, host_tag

    nvme = tmp_path / "nvme"
    trap = nvme / f"{SWAP_PREFIX}{host_tag()}-{int(Path('/proc/sys/kernel/pid_max').read_text()) + 1}-ab12_cd"
    trap.mkdir(parents=True)
    os.mkfifo(trap / LOCK_NAME)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            torch.manual_seed(0)
            with tiered.initialize(MLP(), ds_config(param="nvme", opt="nvme", nvme_path=str(nvme))) as engine:
                _train(engine, 1)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():
        os.close(os.open(trap / LOCK_NAME, os.O_WRONLY | os.O_NONBLOCK))
        t.join(30)
        pytest.fail("tiered.initialize blocked on a FIFO named 'lock' in a stale swap folder")
    assert not errors, errors
    assert (trap / LOCK_NAME).exists()  # another user's trap is left alone (with a WARNING), not opened
