"""``torchvision.datasets`` stand-in: CIFAR10 and FakeData as synthetic, deterministic images."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image


class _Images:
    def __init__(
        self,
        n: int,
        hw: tuple[int, int],
        channels: int,
        classes: int,
        seed: int,
        transform: Callable[[Any], Any] | None,
        target_transform: Callable[[Any], Any] | None,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.data = rng.integers(0, 256, size=(n, hw[0], hw[1], channels), dtype=np.uint8)
        self.targets = [int(t) for t in rng.integers(0, classes, size=n)]
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        arr = self.data[index]
        img = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        target = self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


class CIFAR10(_Images):
    """torchvision's CIFAR10 signature; 32x32 RGB images of 10 classes, TIERED_FAKE_CIFAR10_TRAIN /
    _TEST of them (default 256 / 64)."""

    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

    def __init__(
        self,
        root: str,
        train: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        download: bool = False,
    ) -> None:
        n = int(
            os.environ.get(
                "TIERED_FAKE_CIFAR10_TRAIN" if train else "TIERED_FAKE_CIFAR10_TEST", 256 if train else 64
            )
        )
        super().__init__(n, (32, 32), 3, 10, 10 if train else 11, transform, target_transform)
        self.root, self.train = root, train


class FakeData(_Images):
    """torchvision's FakeData signature (its own generator, seeded by random_offset)."""

    def __init__(
        self,
        size: int = 1000,
        image_size: tuple[int, int, int] = (3, 224, 224),
        num_classes: int = 10,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        random_offset: int = 0,
    ) -> None:
        c, h, w = image_size
        super().__init__(size, (h, w), c, num_classes, random_offset, transform, target_transform)
