"""The "faults" and "stripe" backends reach tiered through the installed entry points, as every
built-in backend does (the test conftests register them only where the install predates them).

This fails until tiered is reinstalled after pyproject.toml changed: run ``pip install -e .``
(``./dev.sh`` does on a fresh machine)."""

from __future__ import annotations

from importlib import metadata

import pytest


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("faults", "tiered_faults:FaultsBackend"),
        ("stripe", "tiered_stripe:StripeBackend"),
        ("checksum", "tiered_checksum:ChecksumBackend"),
    ],
)
def test_backend_is_an_installed_entry_point(name: str, target: str) -> None:
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="tiered.backends")}
    assert installed.get(name) == target, (
        f"the installed tiered has no {name!r} entry point (it has {sorted(installed)}): "
        "reinstall it with `pip install -e .`"
    )
    ep = next(ep for ep in metadata.entry_points(group="tiered.backends") if ep.name == name)
    assert ep.load().name == name  # the class it names imports, and registers under its own name
