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


def test_the_schedule_counters_have_one_writer() -> None:
    """[Note: one writer of the schedule counters]: no module but tiered/zero/counters.py writes a
    counter by its name (``c["fetches"] += 1``, under any alias) or reaches into its counts; the
    coordinator, the group runtime and the saved-tensor hooks once each did, one count from two files."""
    import ast

    from tiered.zero.counters import COUNTERS, ScheduleCounters

    root = Path(tiered.__file__).parent
    owner = root / "zero" / "counters.py"
    writes = []
    for path in sorted(root.rglob("*.py")):
        if path == owner:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                [node.target]
                if isinstance(node, ast.AugAssign | ast.AnnAssign)
                else node.targets
                if isinstance(node, ast.Assign | ast.Delete)
                else []
            )
            for t in targets:
                key = t.slice if isinstance(t, ast.Subscript) else None
                if isinstance(key, ast.Constant) and key.value in COUNTERS:
                    writes.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "_counts":
                writes.append(f"{path.relative_to(root)}:{node.lineno} (._counts)")
    assert writes == [], f"schedule counters written outside tiered/zero/counters.py: {writes}"
    counters = ScheduleCounters()
    with pytest.raises(TypeError):
        counters["fetches"] = 1  # type: ignore[index]
    counters.count_fetch(prefetched=False, cached=False)
    assert counters["fetches"] == counters["misses"] == 1 and counters.as_dict()["prefetch_hits"] == 0


def test_one_autograd_function_runs_a_callback_in_backward() -> None:
    """The module-output re-gather and the leaf-input flush use one `CallInBackward`
    (tiered/zero/hooks.py); hooks.py and leaf.py once each had their own copy of it."""
    import ast

    found = []
    for path in sorted((Path(tiered.__file__).parent / "zero").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).endswith("Function") for b in node.bases
            ):
                found.append(f"{path.name}:{node.name}")
    assert found == ["hooks.py:CallInBackward"]
