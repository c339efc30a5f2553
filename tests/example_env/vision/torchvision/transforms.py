"""``torchvision.transforms`` stand-in: the transforms DeepSpeedExamples' scripts compose."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """PIL image (H, W, C) uint8 -> float tensor (C, H, W) in [0, 1], as torchvision's."""

    def __call__(self, pic: Image.Image) -> torch.Tensor:
        arr = np.array(pic, dtype=np.uint8, copy=True)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return torch.from_numpy(arr).permute(2, 0, 1).contiguous().float().div(255)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = list(mean), list(std)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=t.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=t.dtype).view(-1, 1, 1)
        return (t - mean) / std


class Resize:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        if min(w, h) == self.size:
            return img
        if w <= h:
            return img.resize((self.size, int(self.size * h / w)), Image.BILINEAR)
        return img.resize((int(self.size * w / h), self.size), Image.BILINEAR)


class CenterCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        left, top = (w - self.size) // 2, (h - self.size) // 2
        return img.crop((left, top, left + self.size, top + self.size))
