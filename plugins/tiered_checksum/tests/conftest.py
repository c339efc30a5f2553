"""Until tiered is reinstalled (``pip install -e .``), the installed entry points may predate the
"checksum" backend: register it here, by dotted path, only where it is missing.
`tiered_stripe/tests/test_plugin_entry_points.py` checks the real entry points."""

from __future__ import annotations

import tiered
from tiered.storage import known_backends

for _name, _target in (
    ("checksum", "tiered_checksum:ChecksumBackend"),
    ("faults", "tiered_faults:FaultsBackend"),
    ("stripe", "tiered_stripe:StripeBackend"),
):
    if _name not in known_backends():
        tiered.register_backend(_name, _target)
