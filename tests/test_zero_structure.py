"""The shape of tiered/zero: one-way imports (TYPE_CHECKING imports included), the shard-group
interface below both zero/ and optim/, modules within the house size."""

from __future__ import annotations

from pathlib import Path

import pytest

import tiered

# a test extra (import-linter's graph library): a GPU machine with tiered installed --no-deps
# may lack it, and this module must not stop `pytest -m cuda` from collecting the others
grimp = pytest.importorskip("grimp")


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("tiered", exclude_type_checking_imports=False)


def test_zero_modules_import_one_way() -> None:
    graph = _graph()
    modules = sorted(graph.find_descendants("tiered.zero") | {"tiered.zero"})
    circles = [
        (a, b)
        for i, a in enumerate(modules)
        for b in modules[i + 1 :]
        if graph.chain_exists(a, b) and graph.chain_exists(b, a)
    ]
    assert circles == [], f"import circles in tiered.zero: {circles}"


def test_shard_groups_sit_below_zero_and_optim() -> None:
    graph = _graph()
    assert not graph.chain_exists("tiered.optim", "tiered.zero", as_packages=True)
    assert not graph.chain_exists("tiered.zero", "tiered.optim", as_packages=True)
    for pkg in ("tiered.zero", "tiered.optim"):  # (it names the tiers' Partition: tiers sit below)
        assert not graph.chain_exists("tiered.shards", pkg, as_packages=True), pkg
    assert graph.direct_import_exists(importer="tiered.optim.offload", imported="tiered.shards")
    assert graph.direct_import_exists(importer="tiered.zero.coordinator", imported="tiered.shards")


def test_zero_modules_stay_under_500_lines() -> None:
    zero = Path(tiered.__file__).parent / "zero"
    long = {p.name: n for p in zero.glob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
