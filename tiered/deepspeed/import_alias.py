"""The module name ``deepspeed`` for tiered's DeepSpeed API: an import finder, and the folder
`tiered run` puts first on PYTHONPATH.

[Note: deepspeed as an alias of tiered.deepspeed]
A DeepSpeed script imports DeepSpeed under its own name, in many forms: ``import deepspeed``,
``from deepspeed import comm as dist``, ``import deepspeed.comm as dist``, ``from
deepspeed.accelerator import get_accelerator``, ``from deepspeed.ops.adam import
DeepSpeedCPUAdam``. For such a script to run on tiered with no line changed, every one of those
must give tiered's module, whether DeepSpeed is installed or not, and give the *same* module
object as ``tiered.deepspeed.X`` (one accelerator, one set of classes for ``isinstance``).

Two pieces do it. `DeepSpeedAlias`, a finder first on ``sys.meta_path``, answers each
``deepspeed.X.Y`` with tiered.deepspeed.X.Y itself (its loader returns the already-imported
module; nothing is executed twice), and ``sys.modules["deepspeed"]`` is tiered.deepspeed.
Importing tiered.deepspeed installs both, so ``import tiered.deepspeed as deepspeed`` followed by
``from deepspeed import comm`` resolves to tiered's too. A fresh interpreter has not imported
tiered yet, so `tiered run` puts ``SHIM_DIR`` first on PYTHONPATH: it holds a ``deepspeed``
package whose only work is to import tiered.deepspeed (installing the finder) and stand aside
for it. PYTHONPATH reaches every process of the job: the ranks torchrun starts, DataLoader workers
under the spawn or forkserver start methods (which re-import the script), and any Python the
script launches. Neither piece writes a file or a ``.pth`` into the environment.

A name tiered does not have (``deepspeed.ops.transformer``) is a ``ModuleNotFoundError`` naming
it and the table of what there is; a module of a feature tiered refuses (``deepspeed.pipe``) is
that feature's error ([Note: refused DeepSpeed features]). If DeepSpeed's own package was imported
in the process before tiered.deepspeed, it keeps the name (replacing a module scripts already hold
would split their state between two implementations): a warning says so, and the finder stays
out of the way.

Libraries that probe for DeepSpeed read its installed distribution (transformers' and
accelerate's ``is_deepspeed_available`` ask ``importlib.metadata`` for a version): the alias
adds no distribution, so without DeepSpeed installed they still see none and take no DeepSpeed
path; ``importlib.util.find_spec("deepspeed")`` on the other hand finds the alias.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Sequence
from pathlib import Path

from tiered.deepspeed.unsupported import feature_of_module, refuse

log = logging.getLogger(__name__)

ALIAS = "deepspeed"
TARGET = "tiered.deepspeed"
SHIM_DIR = Path(__file__).resolve().parent / "shim"
"""The folder `tiered run` puts first on PYTHONPATH: it holds the ``deepspeed`` stand-in."""

SHIM_MARK = "__tiered_deepspeed_shim__"
"""Set on the stand-in module of SHIM_DIR, so `install` can tell it from DeepSpeed's own."""

__all__ = ["ALIAS", "SHIM_DIR", "DeepSpeedAlias", "install", "is_aliased"]


class _AliasLoader(importlib.abc.Loader):
    """Gives the already-imported tiered module for an aliased name (executes nothing)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    """``deepspeed.X`` -> tiered.deepspeed.X while ``sys.modules["deepspeed"]`` is tiered's."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        ours = sys.modules.get(TARGET)
        current = sys.modules.get(ALIAS)
        if current is not None and current is not ours and not getattr(current, SHIM_MARK, False):
            return None  # DeepSpeed's own package holds the name in this process
        feature = feature_of_module(fullname)
        real = f"tiered.{fullname}"
        found = importlib.util.find_spec(real)
        if found is None:
            if feature is not None:
                refuse(feature, f"import {fullname}")
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: `deepspeed` is tiered's DeepSpeed API here (tiered run, or "
                f"import tiered.deepspeed), which has no {fullname}; docs/deepspeed.md lists what it has",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(real), is_package=found.submodule_search_locations is not None
        )


def is_aliased() -> bool:
    """True when ``import deepspeed`` gives tiered.deepspeed in this process."""
    return sys.modules.get(ALIAS) is sys.modules.get(TARGET) is not None


def install() -> bool:
    """Make ``deepspeed`` and its submodules tiered's in this process (idempotent). Returns False,
    with a warning, when DeepSpeed's own package was imported first (it keeps the name)."""
    ours = sys.modules[TARGET]
    current = sys.modules.get(ALIAS)
    if current is not None and current is not ours and not getattr(current, SHIM_MARK, False):
        log.warning(
            "DeepSpeed's own package (%s) was imported before tiered.deepspeed: `deepspeed` and its "
            "submodules stay DeepSpeed's in this process; import tiered.deepspeed first (or run the script "
            "with `tiered run`) for every deepspeed import to be tiered's",
            getattr(current, "__file__", current),
        )
        return False
    if not any(isinstance(f, DeepSpeedAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAlias())
    sys.modules[ALIAS] = ours
    return True
