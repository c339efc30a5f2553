"""Backends that open other backends from nested specs (fault injection, striping, ...).

A wrapper's spec names its own options and the spec(s) of the backend(s) it wraps, for example
``{"type": "faults", "inner": {"type": "nvme", "path": ...}, "faults": [...]}``. Two rules every
wrapper needs, kept here so each plugin does not grow its own copy:

- the keywords `open_backend` itself passes to every backend (today: `bridge`) are handed on to
  the wrapped backends; any other keyword is a misspelt spec key and an error naming it;
- an error opening a wrapped backend is re-raised with the place in the outer spec prefixed
  (``backend 'stripe' members[1]: ...``), keeping its type so callers can still catch it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any

from tiered.errors import ConfigError
from tiered.storage.base import StorageBackend
from tiered.storage.registry import open_backend


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
