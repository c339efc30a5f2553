"""``tiered.auto_config``: the memories a config asks the planner to fit it to, read and
checked where they enter ([Note: auto config] in tiered/planning/auto.py resolves them).

Its keys are classified with the others (key_rules.py); this module reads them into an
`AutoRequest` and hands back the config without the section, so the planner reads no raw key.
An error names a key as the user gave it: ``tiered.auto_config.cpu_mem`` in a config, or
``--auto-config cpu_mem`` where `tiered finetune --auto-config` gave it (`spelled`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered.config.keys import check_section
from tiered.config.values import as_section, as_str
from tiered.units import parse_bytes

SECTION = "tiered.auto_config"
MEMORY_KEYS = ("cpu_mem", "gpu_mem", "nvme_mem", "activation_mem")
AUTO_KEYS = (*MEMORY_KEYS, "bandwidth")
CONFIG_SPELLING = f"{SECTION}."
"""The prefix of a key's name in errors where the config gave it."""


@dataclass(frozen=True)
class AutoRequest:
    """The memories given (bytes; None: not given, not checked) and the bandwidth file."""

    memories: Mapping[str, int | None]
    """`MEMORY_KEYS` -> bytes."""
    bandwidth: str | None
    spelled: str
    """How a key is named in errors: `CONFIG_SPELLING` or ``"--auto-config "``."""

    def name(self, key: str) -> str:
        return f"{self.spelled}{key}"


def has_auto_config(raw: Any) -> bool:
    """Whether `raw` asks for ``tiered.auto_config``."""
    return isinstance(raw, dict) and isinstance(raw.get("tiered"), dict) and "auto_config" in raw["tiered"]


def split_auto_config(
    raw: Mapping[str, Any], spelled: str = CONFIG_SPELLING
) -> tuple[AutoRequest, dict[str, Any]]:
    """The request of `raw`'s ``tiered.auto_config`` (checked) and a copy of `raw` without it."""
    rest = copy.deepcopy(dict(raw))
    section_name = spelled.strip().rstrip(".")
    section = as_section(rest["tiered"].pop("auto_config"), section_name)
    check_section(section, SECTION)
    memories = {
        key: None if section.get(key) is None else parse_bytes(section[key], what=f"{spelled}{key}")
        for key in MEMORY_KEYS
    }
    bandwidth = section.get("bandwidth")
    path = None if bandwidth is None else as_str(bandwidth, f"{spelled}bandwidth")
    return AutoRequest(memories, path, spelled), rest
