"""No silent wrong results, nothing left behind, owner-only files (issue: reliability): a second
initialize on one module, a budget above what the machine has, a failed initialize's swap folder,
over-long keys in every backend, file and directory modes, backends named by code strings."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import CASES, build, ds_config

import tiered
from tiered.errors import AlreadyManagedError, BackendNotFoundError, CapacityError, StorageKeyError
from tiered.storage import open_backend
from tiered.units import parse_bytes


def test_a_second_initialize_on_a_managed_module_is_refused_naming_the_first_engine() -> None:
    case = CASES["mlp"]
    model = build(case)
    first = tiered.initialize(model, ds_config())
    try:
        with pytest.raises(
            AlreadyManagedError, match=r"already managed by engine .*Engine.*close\(\)"
        ) as info:
            tiered.initialize(model, ds_config())
        assert f"{id(first):#x}" in str(info.value)
    finally:
        first.close()
    tiered.initialize(model, ds_config()).close()  # closed: the module may be managed again


def test_a_budget_above_what_the_host_has_is_refused_with_both_numbers() -> None:
    cfg = ds_config(cpu_budget="1000PB")
    with pytest.raises(CapacityError) as info:
        tiered.initialize(build(CASES["mlp"]), cfg)
    msg = str(info.value)
    assert "tiered.tiers.cpu.budget" in msg and str(parse_bytes("1000PB")) in msg, msg
    assert "has in all" in msg and "bytes)" in msg.split("has in all", 1)[1], msg


def _swap_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith("tiered-swap-")]


def test_a_failed_initialize_leaves_no_swap_folder(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(nvme))
    cfg["tiered"] = {"tiers": {"zz_custom": {"backend": {"type": "no-such-backend"}}}}
    with pytest.raises(BackendNotFoundError, match="no-such-backend"):
        tiered.initialize(build(CASES["mlp"]), cfg)
    assert _swap_dirs(nvme) == [], "the swap folder of the nvme tier opened first was left behind"


def _backends(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "n").mkdir()
    (tmp_path / "s").mkdir()
    (tmp_path / "f").mkdir()
    (tmp_path / "c").mkdir()
    return {
        "cpu": {"type": "cpu"},
        "nvme": {"type": "nvme", "path": str(tmp_path / "n")},
        "stripe": {"type": "stripe", "paths": [str(tmp_path / "s")]},
        "faults": {"type": "faults", "inner": {"type": "nvme", "path": str(tmp_path / "f")}},
        "checksum": {"type": "checksum", "inner": {"type": "nvme", "path": str(tmp_path / "c")}},
    }


@pytest.mark.parametrize("name", ["cpu", "nvme", "stripe", "faults", "checksum"])
def test_an_over_long_key_is_a_storage_key_error_in_every_backend(tmp_path: Path, name: str) -> None:
    import asyncio

    spec = _backends(tmp_path)[name]
    key = "k" * 239

    async def go() -> None:
        b = open_backend(spec)
        try:
            with pytest.raises(StorageKeyError, match=r"239 characters.*at most 200"):
                await b.write(key, torch.zeros(4))
            await b.write("k" * 200, torch.zeros(4))  # the longest key is fine everywhere
        finally:
            await b.close()

    asyncio.run(go())


def test_offload_files_are_owner_only(tmp_path: Path) -> None:
    import asyncio

    async def go() -> None:
        b = open_backend({"type": "nvme", "path": str(tmp_path / "new"), "create": True})
        try:
            await b.write("g0000.exp_avg_sq", torch.ones(16))
        finally:
            await b.close()

    asyncio.run(go())
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "g0000.exp_avg_sq").st_mode) == 0o600


@pytest.mark.parametrize("target", ["os:system", "os.system", "subprocess:Popen", "builtins:eval"])
def test_a_config_string_naming_code_is_not_imported(target: str, tmp_path: Path) -> None:
    with pytest.raises(BackendNotFoundError, match="register_backend"):
        open_backend({"type": target})
    cfg = ds_config()
    cfg["tiered"] = {"tiers": {"x": {"backend": {"type": target}}}}
    with pytest.raises(BackendNotFoundError):
        tiered.initialize(build(CASES["mlp"]), cfg)


def _declared_tier_cfg(path: Path) -> dict[str, Any]:
    cfg = ds_config(param="cpu", opt="cpu")
    cfg["tiered"] = {
        "tiers": {"mine": {"backend": {"type": "nvme", "path": str(path)}}},
        "param_tier": "mine",
        "optimizer_tier": "mine",
    }
    return cfg


def test_close_flushes_a_user_declared_persistent_tier(tmp_path: Path) -> None:
    """Trained, closed without flush(): a reopened tier holds the trained parameters (fp32: the
    param file is the master too) and the optimizer state (issue: reliability, item 7)."""
    import asyncio

    from engine_support import make_batches

    (tmp_path / "mine").mkdir()
    case = CASES["mlp"]
    eng = tiered.initialize(build(case), _declared_tier_cfg(tmp_path / "mine"))
    for b in make_batches(case, 3, 4):
        eng.backward(case.loss(eng(**b)))
        eng.step()
    groups = [
        (g.param.name, g.param.numel, [(e.name, e.offset, e.numel) for e in g.entries])
        for g in eng.zero.groups
    ]
    exp_avg = {g.name: eng.optimizer.state_partitions(g).exp_avg.name for g in eng.zero.groups}
    moments = {}
    for g in eng.zero.groups:
        part = eng.optimizer.state_partitions(g).exp_avg
        moments[part.name] = eng.tm.fetch(part, "cpu").result().clone()
        eng.tm.release(part, "cpu")
    eng.close()  # no flush() first
    trained = {n: p.detach().reshape(-1) for n, p in eng.module.named_parameters()}

    async def read_back() -> dict[str, torch.Tensor]:
        b = open_backend({"type": "nvme", "path": str(tmp_path / "mine")})
        try:
            out = {}
            for key, numel in [(k, n) for k, n, _ in groups] + [
                (k, moments[k].numel()) for k in exp_avg.values()
            ]:
                out[key] = torch.empty(numel, dtype=torch.float32)
                await b.read(key, out[key])
            return out
        finally:
            await b.close()

    stored = asyncio.run(read_back())
    for key, _, entries in groups:
        for name, offset, numel in entries:
            assert torch.equal(stored[key][offset : offset + numel], trained[name]), (
                f"{name}: the tier holds stale values after close()"
            )
    for key, want in moments.items():
        assert torch.equal(stored[key], want), key


def test_an_error_in_a_with_block_is_not_replaced_by_a_close_that_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every write-back to the declared tier fails (a full disk), then the block raises its own
    error: that error reaches the caller; the close's (the write-backs, the flush) is logged."""
    from engine_support import make_batches

    (tmp_path / "mine").mkdir()
    cfg = _declared_tier_cfg(tmp_path / "mine")
    inner = cfg["tiered"]["tiers"]["mine"]["backend"]
    fault = {"kind": "error", "op": "write", "errno": "ENOSPC", "after": 12}  # after initialize
    cfg["tiered"]["tiers"]["mine"]["backend"] = {"type": "faults", "inner": inner, "faults": [fault]}
    case = CASES["mlp"]
    with pytest.raises(ValueError, match="the block's own error"):
        with tiered.initialize(build(case), cfg) as eng:
            b = make_batches(case, 1, 4)[0]
            eng.backward(case.loss(eng(**b)))
            eng.step()
            raise ValueError("the block's own error")
    assert "after an error in its `with` block failed as well" in caplog.text
    assert "No space left on device" in caplog.text or "ENOSPC" in caplog.text
