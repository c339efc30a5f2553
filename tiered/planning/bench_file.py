"""`tiered bench --json FILE`, read back for `tiered plan --bandwidth FILE` and `--auto-config
bandwidth=FILE`: the file read as [Note: files a user names] says, and every field the plan uses
checked once, here, so the readers get numbers they can divide by.

A bandwidth or rate the plan divides by must be a finite number > 0 (JSON allows NaN and
Infinity through Python's parser, a bool is an int to Python, and a negative rate predicts
negative seconds); a result it reads must have the shape the bench writes. A field the bench
only writes for humans (names, details) is not checked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tiered.config.user_files import read_user_json
from tiered.errors import ConfigError

BENCH_MAX_BYTES = 64 << 20
"""The largest bench JSON read (a sweep over every size and backend is well under a megabyte)."""


def read_bench_json(path: str | Path, what: str = "--bandwidth") -> dict[str, Any]:
    """The bench JSON at `path` (passed as `what`), its "methods", "gpu_link", "compute",
    "cpu_adam" and "host_copy" entries checked ([Note: files a user names]); ConfigError naming the field otherwise."""
    hint = "pass the file tiered bench --json FILE wrote"
    doc = read_user_json(path, what, BENCH_MAX_BYTES, hint=hint, not_json="not a JSON file")
    where = f"{what} {path}"
    methods = doc.get("methods") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or not isinstance(methods, list)
        or not all(isinstance(m, dict) for m in methods)
    ):
        raise ConfigError(f'{where}: not tiered bench\'s JSON (no "methods" list of results); {hint}')
    for i, m in enumerate(methods):
        if m.get("status") == "ok":
            for key in ("read_gbps", "write_gbps"):
                if m.get(key) not in (None, 0):  # 0 or none: not measured, the plan skips the method
                    _rate(m[key], f"{where}: methods[{i}].{key}")
    link = doc.get("gpu_link")
    if link is not None:
        if not isinstance(link, dict):
            raise ConfigError(f"{where}: gpu_link is {type(link).__name__}, not an object; {hint}")
        if link.get("available"):
            for key in ("h2d_gbps", "d2h_gbps"):
                pair = link.get(key)
                if not isinstance(pair, dict) or "pinned" not in pair:
                    raise ConfigError(f'{where}: gpu_link.{key} has no "pinned" rate; {hint}')
                _rate(pair["pinned"], f"{where}: gpu_link.{key}.pinned")
    for entry, key in (("compute", "flops_per_s"), ("cpu_adam", "elements_per_s"), ("host_copy", "gbps")):
        section = doc.get(entry)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: {entry} is {type(section).__name__}, not an object; {hint}")
        if key in section:
            _rate(section[key], f"{where}: {entry}.{key}")
    return doc


def _rate(value: Any, where: str) -> float:
    """`value` as a rate: a finite number > 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"{where} is {value!r}; a measured rate is a finite number > 0 (GB/s, FLOP/s or elements/s): re-run tiered "
            "bench --json or fix the file"
        )
    return float(value)
