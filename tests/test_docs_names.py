"""What README.md and docs/*.md name exists: every repository path, every `tiered...` module or
attribute, and every class name they put in backticks (docs/architecture.md once described
checkpoints as "not written yet" and a storage/memory.py that was never there)."""

from __future__ import annotations

import builtins
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

from tiered.config.keys import RULES
from tiered.storage.registry import ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_ROOTS = ("tiered", "tiered_ext", "plugins", "tests", "benchmarks", "examples")
TICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"[\w.-]+(?:/[\w.*-]+)+/?")
DOTTED = re.compile(r"(?:tiered|tiered_\w+)(?:\.\w+)+(?:\(\))?")
CAMEL = re.compile(r"[A-Z][a-z0-9]+[A-Z]\w*(?:\(\))?")

# Names from other projects the docs compare with: (module that holds it, or None for a word that
# is no Python name). Checked by import where that project is installed.
EXTERNAL = {
    "HfTrainerDeepSpeedConfig": "transformers.integrations.deepspeed",
    "MixtralSparseMoeBlock": "transformers.models.mixtral.modeling_mixtral",
    "Qwen2MoeSparseMoeBlock": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "DeepSpeedCPUAdam": "deepspeed.ops.adam",
    "FusedAdam": "deepspeed.ops.adam",
    "PipelineModule": "deepspeed.pipe",
    "DataLoader": "torch.utils.data",
    "DistributedSampler": "torch.utils.data",
    "RandomSampler": "torch.utils.data",
    "DatasetDict": "datasets",
    "DeepSpeedPlugin": "accelerate.utils",
    "MemAvailable": None,  # a /proc/meminfo field
}


def _code_files() -> list[Path]:
    return [p for top in CODE_ROOTS for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]


@cache
def _defined_names() -> frozenset[str]:
    """Classes and module-level names defined anywhere in the repository's code."""
    names: set[str] = set()
    for p in _code_files():
        text = p.read_text(errors="replace")
        names |= set(re.findall(r"^\s*class (\w+)", text, re.M))
        names |= set(re.findall(r"^(\w+)(?:: [^=\n]+)? = ", text, re.M))
    return frozenset(names)


@cache
def _path_roots() -> frozenset[str]:
    """First segments that make a backticked a/b a repository path (others are user paths:
    DIR/final, checkpoint-N/...)."""
    tops = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    subpackages = {p.name for p in (ROOT / "tiered").iterdir() if p.is_dir()}
    plugins = {p.name for p in (ROOT / "plugins").iterdir() if p.is_dir()}
    return frozenset(tops | subpackages | plugins)


def _resolves(dotted: str) -> bool:
    parts = dotted.removesuffix("()").split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _problems(doc: Path) -> list[str]:
    out = []
    for token in (m.group(1).strip() for m in TICKED.finditer(doc.read_text())):
        if token in RULES or token == ENTRY_POINT_GROUP:
            continue  # a config key (tests/test_config_declared.py) or the entry-point group
        if PATH.fullmatch(token) and token.split("/")[0] in _path_roots():
            if "*" not in token and not any(
                (base / token).exists() for base in (ROOT, ROOT / "tiered", ROOT / "plugins")
            ):
                out.append(f"path {token}")
        elif re.fullmatch(r"\w+\.py", token):
            if not any(p.name == token for p in _code_files()):
                out.append(f"file {token}")
        elif DOTTED.fullmatch(token):
            if not _resolves(token):
                out.append(f"name {token}")
        elif CAMEL.fullmatch(token):
            name = token.removesuffix("()")
            if name in EXTERNAL:
                module = EXTERNAL[name]
                if module is not None:
                    try:
                        holder = importlib.import_module(module)
                    except ImportError:
                        continue  # that project is not installed here
                    if not hasattr(holder, name):
                        out.append(f"external {name} (not in {module})")
            elif name not in _defined_names() and not hasattr(builtins, name):
                out.append(f"class {name}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_name_only_what_exists(doc: Path) -> None:
    problems = _problems(doc)
    assert not problems, f"{doc.relative_to(ROOT)} names what does not exist: {problems}"


def test_the_check_catches_a_missing_path_module_and_class(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text(
        "`storage/memory.py` `tiered.storage.memory.ResidentMemoryBackend` `MemoryBackendPool` `tiered.timeout_s`"
    )
    assert _problems(doc) == [
        "path storage/memory.py",
        "name tiered.storage.memory.ResidentMemoryBackend",
        "class MemoryBackendPool",
    ]
