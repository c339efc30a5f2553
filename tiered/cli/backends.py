"""`tiered backends`: list the registered storage backends and whether each one imports."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tiered.errors import BackendImportError
from tiered.storage.registry import get_backend_class, known_backends

DESCRIPTION = """\
List every storage backend tiered can open: the built-in ones (gpu, cpu, nvme, aiofiles,
tensorstore) and any third-party plugin registered through the "tiered.backends" entry-point group.
For each: its dotted path, whether it imports here (and what to install if not) and its
capabilities. Open one in Python with tiered.open_backend({"type": NAME, ...}).
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "backends",
        help="list the registered storage backends",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(run=run)
    return parser


def describe_backends() -> list[dict[str, Any]]:
    """One dict per backend: name, target, source, importable, error, capabilities."""
    rows: list[dict[str, Any]] = []
    for name, info in known_backends().items():
        row: dict[str, Any] = info.to_json()
        try:
            cls = get_backend_class(name)
        except BackendImportError as exc:
            row.update(importable=False, error=str(exc), capabilities=None)
        else:
            caps = getattr(cls, "static_capabilities", None)
            row.update(importable=True, error=None, capabilities=caps.to_json() if caps is not None else None)
        rows.append(row)
    return rows


def _caps_text(caps: dict[str, Any] | None) -> str:
    if caps is None:
        return "depends on options"
    flags = [k for k in ("persistent", "memory_like", "direct_gpu") if caps.get(k)]
    return ",".join(flags) + f" align={caps.get('alignment_bytes', 1)}"


def run(args: argparse.Namespace) -> int:
    rows = describe_backends()
    out = sys.stdout
    if getattr(args, "json", False):
        out.write(json.dumps(rows, indent=2) + "\n")
        return 0
    table = [("NAME", "TARGET", "IMPORTS", "CAPABILITIES")]
    for r in rows:
        table.append(
            (r["name"], r["target"], "yes" if r["importable"] else "NO", _caps_text(r["capabilities"]))
        )
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")
    for r in rows:
        if not r["importable"]:
            out.write(f"\n{r['name']}: {r['error']}\n")
    return 0
