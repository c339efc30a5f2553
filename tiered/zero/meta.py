"""Materialising a meta-device model one group at a time, straight into its tier.

[Note: meta materialisation]
A model too large for host memory is built under ``torch.device("meta")`` (shapes only). While
partitioning, each group's parameters get real storage on the host just long enough to be
initialised and copied into the group's partition; then the storage is dropped again, so peak
host memory for parameters is about one group. Initialisation runs, per owning module, the
Hugging Face root model's ``_init_weights(module)`` when the root has one (so HF models get
exactly their own init), else the module's ``reset_parameters()``; a module with neither is an
error naming it (its parameters would otherwise hold garbage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MetaInitError(ValueError):
    pass


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    out: dict[int, tuple[str, nn.Module]] = {}
    for mname, m in model.named_modules():
        for p in m.parameters(recurse=False):
            out.setdefault(id(p), (mname, m))
    return out


def materialize_group(
    model: nn.Module, params: Sequence[tuple[str, nn.Parameter]], device: torch.device
) -> None:
    """Give the meta parameters in `params` real, initialised storage on `device`."""
    owners = _owners(model)
    init_fn = getattr(model, "_init_weights", None)
    done: set[int] = set()
    for _qual, p in params:
        if p.device.type != "meta":
            continue
        mname, module = owners[id(p)]
        if id(module) in done:
            continue
        done.add(id(module))
        # give every meta parameter of the module storage, so init functions can run on all of them
        for q in module.parameters(recurse=False):
            if q.device.type == "meta":
                # a meta tensor cannot take host storage through .data; swap_tensors keeps the
                # Parameter object (so groups, tied owners and optimizers still refer to it)
                torch.utils.swap_tensors(
                    q,
                    nn.Parameter(
                        torch.empty(q.shape, dtype=q.dtype, device=device), requires_grad=q.requires_grad
                    ),
                )
        _empty_buffers(module, device)
        _init_module(mname, module, init_fn)


def _empty_buffers(module: nn.Module, device: torch.device) -> bool:
    found = False
    for bname, buf in list(module._buffers.items()):
        if buf is not None and buf.is_meta:
            module._buffers[bname] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            found = True
    return found


def _init_module(mname: str, module: nn.Module, init_fn: object) -> None:
    with torch.no_grad():
        if callable(init_fn):
            init_fn(module)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()
        else:
            raise MetaInitError(
                f"module {mname!r} ({type(module).__name__}) has parameters or buffers on the meta device but no "
                "reset_parameters() (and the root model has no _init_weights): give it one, or build the "
                "model with real tensors"
            )


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers still on meta (modules without parameters, e.g. rotary tables): give them storage
    and run the module's initialisation, which computes them (HF `_init_weights` does)."""
    init_fn = getattr(model, "_init_weights", None)
    for mname, module in model.named_modules():
        if _empty_buffers(module, device):
            _init_module(mname, module, init_fn)


def drop_meta_storage(p: nn.Parameter) -> None:
    """A meta parameter swapped for an empty host one (same object), so ``.data`` can be set."""
    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad))
