"""RNG states as JSON and tensors (no pickle): torch CPU/CUDA generator states are uint8
tensors (stored in the rank's safetensors file), Python's `random` and numpy's legacy global
state are lists of integers (stored in the manifest)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON part, tensors) of this process's RNG states."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {
            "name": np_name,
            "keys": np.asarray(np_keys).tolist(),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "tensors": sorted(tensors),
    }
    return state, tensors


def restore(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(tensors["rng.torch_cpu"])
    cuda = [
        tensors[k]
        for k in sorted(
            (k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1])
        )
    ]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
