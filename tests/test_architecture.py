"""The layers of docs/architecture.md, enforced: import-linter runs the contracts in pyproject.toml.

Each contract is one test that fails with import-linter's report, which names the offending
import (``tiered.storage.base -> tiered.cli``) or the imports that close a cycle. The bite tests
copy tiered/ aside, add one bad import, and check the same contract then fails naming it, so a
contract that cannot fail (a misspelt layer, a forgotten package) does not pass unnoticed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = {c["id"]: c for c in CONFIG["contracts"]}


def lint_imports(root: Path, contract_id: str) -> subprocess.CompletedProcess[str]:
    """Run one contract on the `tiered` package found under `root` (its own pyproject.toml)."""
    env = dict(os.environ)
    # The package under `root` must win over any installed or PYTHONPATH copy of tiered.
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "plugins"), env.get("PYTHONPATH", "")])
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--config",
            str(root / "pyproject.toml"),
            "--contract",
            contract_id,
            "--no-cache",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("contract_id", sorted(CONTRACTS))
def test_contract_is_kept(contract_id: str) -> None:
    result = lint_imports(ROOT, contract_id)
    assert result.returncode == 0, (
        f"import contract {contract_id!r} ({CONTRACTS[contract_id]['name']}) is broken:\n"
        f"{result.stdout}{result.stderr}"
    )


def _layer_names(contract: dict) -> set[str]:
    names: set[str] = set()
    for layer in contract["layers"]:
        for name in layer.replace(":", "|").split("|"):
            names.add(name.strip().strip("()"))
    return names


def test_every_top_level_module_has_a_layer() -> None:
    """A new package or module under tiered/ must be placed in a layer, or nothing checks it."""
    children = {p.stem for p in (ROOT / "tiered").glob("*.py") if p.stem != "__init__"}
    children |= {p.parent.name for p in (ROOT / "tiered").glob("*/__init__.py")}
    missing = children - _layer_names(CONTRACTS["layers"])
    assert not missing, f"place {sorted(missing)} in a layer of [tool.importlinter] in pyproject.toml"


def test_every_plugin_is_forbidden_to_tiered() -> None:
    plugins = {p.parent.name for p in (ROOT / "plugins").glob("*/__init__.py")}
    listed = set(CONTRACTS["no-plugins"]["forbidden_modules"])
    assert plugins, "no plugin packages found under plugins/"
    assert plugins <= listed, (
        f"add {sorted(plugins - listed)} to forbidden_modules of the 'no-plugins' contract in pyproject.toml"
    )


def test_every_plugin_is_analysed_and_under_the_no_cycles_contract() -> None:
    plugins = {p.parent.name for p in (ROOT / "plugins").glob("*/__init__.py")}
    roots = set(CONFIG["root_packages"])
    cycles = set(CONTRACTS["plugins-no-cycles"]["ancestors"])
    assert plugins <= roots, f"add {sorted(plugins - roots)} to root_packages of [tool.importlinter]"
    assert plugins <= cycles, (
        f"add {sorted(plugins - cycles)} to the 'plugins-no-cycles' contract's ancestors"
    )


def _diagram_layers() -> list[str]:
    """The layer names of docs/architecture.md's diagram: the first column of each unindented
    line of the code block under "## Layers" (siblings separated by " | ")."""
    block = DOC.read_text().split("## Layers", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        if line and not line[0].isspace():
            layers.append(re.split(r"\s{2,}", line.strip())[0])
    return layers


def test_layer_diagram_is_the_layers_contract() -> None:
    """The diagram in docs/architecture.md lists the contract's layers, in its order (it lacked
    integrations, deepspeed and shards while the contract had them)."""

    def siblings(layer: str) -> list[str]:
        return [name.strip().strip("()") for name in layer.split("|")]

    drawn = [siblings(line) for line in _diagram_layers()]
    contract = [siblings(layer) for layer in CONTRACTS["layers"]["layers"]]
    assert drawn == contract, (
        f"docs/architecture.md's layer diagram {drawn} differs from pyproject.toml's layers {contract}"
    )


BAD_IMPORTS = [
    # (contract, file to append to, the import, what the report must name); a path under
    # plugins/ is one of the plugin packages (copied aside as well)
    ("layers", "storage/base.py", "import tiered.tiers.stats", "tiered.storage.base -> tiered.tiers.stats"),
    ("layers", "zero/comm.py", "from tiered.optim import clip", "tiered.zero.comm -> tiered.optim"),
    ("no-plugins", "tiers/stats.py", "import tiered_nvme", "tiered.tiers.stats -> tiered_nvme"),
    (
        "core-without-compat",
        "engine/engine.py",
        "import tiered.deepspeed.facade",
        "tiered.engine.engine -> tiered.deepspeed.facade",
    ),
    ("no-cycles", "device.py", "import tiered.storage.pool", "No cycles are allowed in tiered."),
    (
        "no-cycles",
        "tiers/trace.py",
        "from tiered.tiers import manager",
        "No cycles are allowed in tiered.tiers.",
    ),
    (
        "plugins-no-cycles",
        "plugins/tiered_nvme/pieces.py",
        "import tiered_nvme.backend",
        "No cycles are allowed in tiered_nvme.",
    ),
]


@pytest.mark.parametrize(
    ("contract_id", "rel", "line", "named"), BAD_IMPORTS, ids=[b[0] + ":" + b[1] for b in BAD_IMPORTS]
)
def test_contract_fails_on_a_bad_import(
    tmp_path: Path, contract_id: str, rel: str, line: str, named: str
) -> None:
    shutil.copytree(ROOT / "tiered", tmp_path / "tiered", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        ROOT / "plugins", tmp_path / "plugins", ignore=shutil.ignore_patterns("__pycache__", "tests")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / (rel if rel.startswith("plugins/") else f"tiered/{rel}"), "a") as f:
        f.write(f"\n{line}  # the bad import under test\n")
    result = lint_imports(tmp_path, contract_id)
    report = result.stdout + result.stderr
    assert result.returncode != 0, f"contract {contract_id!r} kept despite `{line}` in {rel}:\n{report}"
    assert named in report, f"the report does not name {named!r}:\n{report}"


def test_version_has_one_source() -> None:
    """pyproject.toml's [project] version, read back from the installed metadata (not a copy)."""
    import tiered

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project and "version" not in project.get("dynamic", [])
    assert tiered.__version__ == project["version"], (
        f"installed metadata says {tiered.__version__}, pyproject.toml says {project['version']}: "
        "reinstall (pip install -e .)"
    )
    init = (ROOT / "tiered" / "__init__.py").read_text()
    assert project["version"] not in init, "tiered/__init__.py repeats the version: read it from metadata"


def test_license_is_an_spdx_string() -> None:
    """project.license as a table ({ text = ... }) made setuptools warn on every install (deprecated
    by PEP 639); the SPDX string form needs setuptools >= 77 to build."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in pyproject["build-system"]["requires"]


DOC = ROOT / "docs" / "architecture.md"
NOTE = re.compile(r"\[Note: ([^\]\n]+)\]")  # a name wrapped over two lines is not seen
SOURCE_ROOTS = ("tiered", "tiered_ext", "plugins", "tests", "benchmarks")
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu", ".md"}


def _notes_index() -> dict[str, str]:
    text = DOC.read_text()
    index_part = text.split("## Notes index", 1)[1]
    return dict(re.findall(r"^\| `\[Note: ([^\]]+)\]` \| `([^`]+)` \|$", index_part, flags=re.M))


def _source_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SOURCE_ROOTS:
        files += [
            p for p in (ROOT / top).rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts
        ]
    return [f for f in files if f != Path(__file__).resolve()]  # this file names notes as patterns


def test_notes_index_lists_every_note_where_it_is() -> None:
    """docs/architecture.md's Notes index names every [Note: ...] in the code, and the file given for
    each holds it: a renamed, moved or new note must be indexed where it now lives."""
    index = _notes_index()
    assert index, "docs/architecture.md has no Notes index table"
    named = {name for f in _source_files() for name in NOTE.findall(f.read_text(errors="replace"))}
    named |= set(NOTE.findall(DOC.read_text().split("## Notes index", 1)[0]))
    named.discard("...")  # prose about notes in general
    missing = sorted(named - set(index))
    assert not missing, f"add to the Notes index of docs/architecture.md: {missing}"
    wrong = sorted(
        f"[Note: {name}] in {rel}"
        for name, rel in index.items()
        if not (ROOT / rel).is_file() or f"[Note: {name}]" not in (ROOT / rel).read_text(errors="replace")
    )
    assert not wrong, f"the Notes index points to files that do not hold these notes: {wrong}"


def test_no_reference_to_a_design_file_outside_the_repo() -> None:
    """Design references resolve inside the project: docs/architecture.md, not a DESIGN.md elsewhere."""
    offenders = [
        str(f.relative_to(ROOT))
        for f in [*_source_files(), ROOT / "pyproject.toml", ROOT / "dev.sh"]
        if "DESIGN.md" in f.read_text(errors="replace")
    ]
    assert not offenders, (
        f"these refer to DESIGN.md (outside the repo); point them to docs/architecture.md: {offenders}"
    )
