"""Backends that open other backends from nested specs (fault injection, striping, ...).

A wrapper's spec names its own options and the spec(s) of the backend(s) it wraps, for example
``{"type": "faults", "inner": {"type": "nvme", "path": ...}, "faults": [...]}``. Two rules every
wrapper needs, kept here so each plugin does not grow its own copy:

- the keywords `open_backend` itself passes to every backend (today: `bridge`) are handed on to
  the wrapped backends; any other keyword is a misspelt spec key and an error naming it;
- an error opening a wrapped backend is re-raised with the place in the outer spec prefixed
  (``backend 'stripe' members[1]: ...``), keeping its type so callers can still catch it.

`WrappingBackend` is the base of a wrapper over one inner backend (faults, checksum) that sees
every byte on its way: it opens the inner backend by those rules and forwards what such a wrapper
forwards unchanged (the bridge, capacity, locations, close, the inner spec in its own).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from tiered.errors import ConfigError
from tiered.storage.base import Capabilities, Capacity, StorageBackend
from tiered.storage.bridge import IOBridge
from tiered.storage.registry import open_backend, spec_host_buffer_bytes


def forwarded_options(options: dict[str, Any], own: Sequence[str], backend: str) -> dict[str, Any]:
    """The keywords a wrapper received beyond its own options, to hand on to the backends it opens.

    Only what `open_backend` itself passes is accepted; anything else is a misspelt spec key: a
    ConfigError naming it, the nearest of `own`, and all of `own`.
    """
    passthrough = set(inspect.signature(open_backend).parameters) - {"spec"}
    for name in options:
        if name not in passthrough:
            close = difflib.get_close_matches(name, list(own), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"backend {backend!r}: unknown option {name!r}.{hint} Accepted options: {', '.join(own)}"
            )
    return dict(options)


def open_nested(spec: Any, forward: dict[str, Any], *, where: str) -> StorageBackend:
    """A wrapped backend from its spec, or an already open backend (which the wrapper then owns).

    `where` names the place in the outer spec; it prefixes any error from opening the backend.
    """
    if isinstance(spec, StorageBackend):
        return spec
    if not isinstance(spec, (dict, str)):
        raise ConfigError(
            f"{where}: expected a backend spec such as {{'type': 'nvme', 'path': ...}}, got {spec!r}"
        )
    try:
        return open_backend(spec, **forward)
    except (ConfigError, KeyError, ImportError, OSError) as exc:
        try:
            err = type(exc)(f"{where}: {exc}")
        except Exception:  # noqa: BLE001 - a type that cannot be rebuilt from a message is raised as it came
            raise exc from None
        raise err from exc


class WrappingBackend(StorageBackend):
    """A backend over one inner backend (``"inner": SPEC``) whose own `write` / `read` /
    `delete` / `exists` do something with every call before or after handing it on.

    A subclass lists its spec keys in `own_options` and calls `open_inner` in its constructor
    (once its own options are checked, so a bad option opens nothing). What it does not override
    goes to the inner backend: the bridge (the inner backend does the blocking calls), capacity,
    `locate`, and `close`. It is never memory-like: a resident tensor handed out by the inner
    backend would bypass the wrapper's `read` and `write`, so `allocate`/`view` stay refused.
    """

    own_options: ClassVar[tuple[str, ...]] = ("inner",)
    """The wrapper's spec keys, offered as the near miss of a misspelt one."""
    inner: StorageBackend

    def open_inner(self, inner: dict[str, Any] | str | StorageBackend, options: dict[str, Any]) -> None:
        """Open (or adopt) the inner backend from `inner`, handing on the keywords of `options`
        that `open_backend` passes; any other keyword is a ConfigError (see `forwarded_options`)."""
        forward = forwarded_options(options, self.own_options, self.name)
        self.inner = open_nested(inner, forward, where=f"backend {self.name!r} option 'inner'")

    @classmethod
    def host_buffer_bytes(cls, options: Mapping[str, Any]) -> int:
        """The inner backend's: a wrapper that sees every byte holds none of its own beyond
        per-call copies."""
        inner = options.get("inner")
        return 0 if inner is None else spec_host_buffer_bytes(inner)

    @property
    def capabilities(self) -> Capabilities:
        return replace(self.inner.capabilities, memory_like=False)

    def capacity(self) -> Capacity:
        return self.inner.capacity()

    def use_bridge(self, bridge: IOBridge | None) -> None:
        """The inner backend does the blocking calls: it gets the bridge too."""
        super().use_bridge(bridge)
        self.inner.use_bridge(bridge)

    def locate(self, key: str) -> str:
        return self.inner.locate(key)

    def spec(self) -> dict[str, Any]:
        """``{"type": name, "inner": the inner spec}``; a wrapper with options of its own adds them."""
        return {"type": self.name, "inner": self.inner.spec()}

    async def close(self) -> None:
        await self.inner.close()
