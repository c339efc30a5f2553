"""``deepspeed`` as `tiered run` provides it: this folder is first on PYTHONPATH, so a script's
``import deepspeed`` lands here, imports tiered.deepspeed (which installs the finder that answers
every ``deepspeed.*`` with tiered's module) and stands aside for it. [Note: deepspeed as an alias
of tiered.deepspeed] in tiered/deepspeed/import_alias.py."""

from __future__ import annotations

import sys

__tiered_deepspeed_shim__ = True

import tiered.deepspeed  # after the mark above: install() reads it

sys.modules[__name__] = tiered.deepspeed
