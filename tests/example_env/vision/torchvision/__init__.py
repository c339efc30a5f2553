"""Stand-in for torchvision (tests/example_env/README.md): synthetic data sets with torchvision's
interfaces, its transforms and save_image. No download, deterministic data."""

from __future__ import annotations

from torchvision import datasets, transforms, utils

__version__ = "0.0+tiered-test-stand-in"
__all__ = ["datasets", "transforms", "utils"]
