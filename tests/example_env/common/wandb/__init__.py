"""Stand-in for wandb (tests/example_env/README.md): importable, and any use of it raises."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    raise RuntimeError(
        f"wandb.{name}: the test environment's wandb stand-in is not to be used (run without --use_wandb)"
    )
