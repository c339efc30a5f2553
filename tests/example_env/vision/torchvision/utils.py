"""``torchvision.utils.save_image`` stand-in: a grid of the batch as one PNG."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image


def save_image(tensor: torch.Tensor, fp: Any, normalize: bool = False, **kwargs: Any) -> None:
    t = tensor.detach().float().cpu()
    if t.dim() == 4:
        t = torch.cat(list(t), dim=2)  # the batch side by side
    if normalize:
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-5)
    arr = (t.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(fp)
