"""`tiered backends`: table and JSON listing, import failures shown with their hint."""

from __future__ import annotations

import argparse
import json

from tiered.cli import backends
from tiered.storage import register_backend, unregister_backend


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(json=False, **kw)


def test_json_lists_builtins_with_capabilities(capsys) -> None:
    assert backends.run(argparse.Namespace(json=True)) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"gpu", "cpu", "nvme", "aiofiles", "tensorstore"} <= set(rows)
    assert rows["nvme"]["importable"] is True and rows["nvme"]["target"] == "tiered_nvme:NVMeBackend"
    assert rows["nvme"]["capabilities"]["persistent"] is True
    assert rows["cpu"]["capabilities"]["memory_like"] is True


def test_table_shows_broken_plugin_and_hint(capsys) -> None:
    register_backend("broken-x", "tiered_missing_mod_q:B", install_hint="pip install tiered-q")
    try:
        assert backends.run(_args()) == 0
    finally:
        unregister_backend("broken-x")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "TARGET", "IMPORTS", "CAPABILITIES"]
    assert any(line.startswith("broken-x") and " NO " in line for line in lines)
    assert "pip install tiered-q" in out
    assert any(line.startswith("nvme") and " yes " in line for line in lines)


def test_plugs_into_an_argparse_frame(capsys) -> None:
    parser = argparse.ArgumentParser(prog="tiered")
    sub = parser.add_subparsers(dest="command")
    backends.add_parser(sub)
    args = parser.parse_args(["backends", "--json"])
    assert args.run(args) == 0
    assert json.loads(capsys.readouterr().out)
