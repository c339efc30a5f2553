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
    return {
        "cpu": {"type": "cpu"},
        "nvme": {"type": "nvme", "path": str(tmp_path / "n")},
        "stripe": {"type": "stripe", "paths": [str(tmp_path / "s")]},
        "faults": {"type": "faults", "inner": {"type": "nvme", "path": str(tmp_path / "f")}},
    }


@pytest.mark.parametrize("name", ["cpu", "nvme", "stripe", "faults"])
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
