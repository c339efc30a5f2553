"""``python -m tiered.config --markdown``: print docs/config.md's key table, generated from the
schema's declarations and keys.py ([Note: one declaration per key] in declare.py)."""

from __future__ import annotations

import sys

from tiered.config.keys import markdown_table

if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m tiered.config --markdown  (the key table of docs/config.md)")
    sys.stdout.write(markdown_table())
