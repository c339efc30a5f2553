"""docs/backends.md cannot rot: its code blocks are installed into a temporary path and used.

The blocks whose first line is ``# file: NAME`` are written to NAME in a temporary directory that
goes on sys.path; then the example backend is registered, trained through as the optimizer tier,
and checked by the conformance suite, exactly as the page tells a user to.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiered
from tiered.storage import unregister_backend

DOC = Path(__file__).resolve().parents[1] / "docs" / "backends.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
EXAMPLE_MODULES = ("dirstore", "register_dirstore", "train_dirstore", "test_dirstore")


def doc_files() -> dict[str, str]:
    files: dict[str, str] = {}
    for _lang, body in BLOCK.findall(DOC.read_text()):
        first, _, rest = body.partition("\n")
        m = re.fullmatch(r"# file: (\S+)", first.strip())
        if m:
            files[m.group(1)] = rest
    return files


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in doc_files().items():
        (src / name).write_text(text)
    monkeypatch.syspath_prepend(str(src))
    for mod in EXAMPLE_MODULES:
        sys.modules.pop(mod, None)
    yield src
    for mod in EXAMPLE_MODULES:
        sys.modules.pop(mod, None)
    unregister_backend("dirstore")


def test_the_page_has_the_example_files() -> None:
    assert set(doc_files()) == {f"{m}.py" for m in EXAMPLE_MODULES}
    lines = [ln for ln in doc_files()["dirstore.py"].splitlines() if ln.strip()]
    assert len(lines) <= 70, f"the 'about 30 lines' backend has grown to {len(lines)} lines"


def test_the_readme_links_the_page() -> None:
    assert "docs/backends.md" in (DOC.parents[1] / "README.md").read_text()


def test_trains_a_tiny_model_through_the_documented_backend(installed: Path, tmp_path: Path) -> None:
    train = importlib.import_module("train_dirstore").train
    store = tmp_path / "store"
    stats = train(str(store))
    links = stats["tiers"]["links"]
    assert links["cpu->mine"]["bytes"] > 0 and links["mine->cpu"]["bytes"] > 0, links
    assert any(store.iterdir()), "no optimizer state was stored in the documented backend's directory"
    # the spec round trip through the registry, as the page promises
    backend = tiered.open_backend({"type": "dirstore", "path": str(store)})
    assert tiered.open_backend(backend.spec()).spec() == backend.spec()


def test_the_documented_backend_passes_conformance(installed: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            str(installed / "test_dirstore.py"),
        ],
        cwd=installed,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed", proc.stdout), proc.stdout[-2000:]
