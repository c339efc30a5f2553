"""Backends by name: entry points ("tiered.backends") plus `register_backend`, imported lazily.

[Note: lazy backend registry]
As fsspec's ``known_implementations``, the registry maps a name to a *dotted path*, not to a class:
listing backends (``tiered backends``) never imports a plugin, and a plugin whose optional
dependency is missing fails only when it is opened, with a `BackendImportError` that carries the
plugin's install hint. Built-in backends live in ``plugins/`` and arrive through the entry-point
group like any third-party one (docs/architecture.md, "Layers"); ``tiered/`` never imports them.

Precedence: a name already known (an entry point, or an earlier `register_backend`) is replaced
only with ``clobber=True``, as fsspec's ``register_implementation`` does: a plugin that happens to
pick a taken name gets an error instead of silently swapping out another backend, and a user who
means to swap in their own "nvme" says so. Registering the same target again is a no-op. Entry
points are read once, on first use.

The registered name is the spec's type: ``backend.spec()["type"]`` must reopen the same backend, yet a class may be registered (or listed
as an entry point) under a name other than its ``name`` attribute: a user's own class swapped in
as "cpu", one class under two names. `open_backend` therefore stamps the name it was opened by
on the instance (``backend.name``), so ``spec()`` (which writes ``self.name``) names the registry
entry that made it and ``open_backend(b.spec())`` round-trips. A backend constructed directly,
not through the registry, keeps its class's ``name``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from tiered.errors import BackendExistsError, BackendImportError, BackendNotFoundError, ConfigError
from tiered.storage.base import StorageBackend
from tiered.storage.bridge import IOBridge

ENTRY_POINT_GROUP = "tiered.backends"


@dataclass(frozen=True)
class BackendInfo:
    """One registry entry. `target` is "module:Class" (or a class object's qualified path)."""

    name: str
    target: str
    install_hint: str = ""
    source: str = "entry_point"
    """"entry_point" or "register_backend"."""
    distribution: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "install_hint": self.install_hint,
            "source": self.source,
            "distribution": self.distribution,
        }


_lock = threading.Lock()
_registered: dict[str, BackendInfo] = {}
_classes: dict[str, type[StorageBackend]] = {}
_entry_points: dict[str, BackendInfo] | None = None


def _load_entry_points() -> dict[str, BackendInfo]:
    global _entry_points
    if _entry_points is None:
        found: dict[str, BackendInfo] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            found[ep.name] = BackendInfo(
                name=ep.name,
                target=ep.value,
                source="entry_point",
                distribution=dist.name if dist is not None else None,
            )
        _entry_points = found
    return _entry_points


def _target_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_backend(
    name: str,
    cls_or_dotted_path: type[StorageBackend] | str,
    *,
    install_hint: str = "",
    clobber: bool = False,
) -> None:
    """Register a backend under `name`: a StorageBackend subclass or a "module:Class" path.

    A dotted path is imported only when the backend is first opened (see
    [Note: lazy backend registry]); `install_hint` is shown if that import fails. A name that is
    already registered or an entry point is replaced only with ``clobber=True`` (fsspec's rule);
    otherwise `BackendExistsError` names what holds it.
    """
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"register_backend: name must be a non-empty identifier-like string, got {name!r}")
    if isinstance(cls_or_dotted_path, str):
        if not cls_or_dotted_path.strip():
            raise ConfigError(f"register_backend({name!r}): empty dotted path")
        target = cls_or_dotted_path
    elif isinstance(cls_or_dotted_path, type) and issubclass(cls_or_dotted_path, StorageBackend):
        target = _target_of(cls_or_dotted_path)
    else:
        raise ConfigError(
            f"register_backend({name!r}): expected a StorageBackend subclass or a 'module:Class' "
            f"string, got {cls_or_dotted_path!r}"
        )
    entry_points = _load_entry_points()
    with _lock:
        held = _registered.get(name) or entry_points.get(name)
        if held is not None and held.target != target and not clobber:
            by = "register_backend" if held.source == "register_backend" else "an entry point"
            dist = f" of distribution {held.distribution!r}" if held.distribution else ""
            raise BackendExistsError(
                f"backend name {name!r} is already taken by {held.target!r} ({by}{dist}); pass "
                f"clobber=True to replace it, or register {target!r} under another name"
            )
        _registered[name] = BackendInfo(name, target, install_hint, "register_backend")
        if isinstance(cls_or_dotted_path, str):
            _classes.pop(name, None)
        else:
            _classes[name] = cls_or_dotted_path


def unregister_backend(name: str) -> None:
    """Remove a `register_backend` entry (entry points stay). Mostly for tests."""
    with _lock:
        _registered.pop(name, None)
        _classes.pop(name, None)


def known_backends() -> dict[str, BackendInfo]:
    """Every backend name, without importing any of them, sorted by name."""
    merged = dict(_load_entry_points())
    merged.update(_registered)
    return dict(sorted(merged.items()))


def _not_found(name: str) -> BackendNotFoundError:
    names = list(known_backends())
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return BackendNotFoundError(
        f"unknown storage backend {name!r}.{hint} Known backends: {', '.join(names) or '(none)'}. "
        "Register one with tiered.register_backend(name, cls) or the 'tiered.backends' entry point."
    )


def _import_target(info: BackendInfo) -> type[StorageBackend]:
    module_name, sep, attr = info.target.partition(":")
    if not sep:  # "pkg.mod.Class"
        module_name, _, attr = info.target.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        hint = info.install_hint
        if not hint and exc.name:
            hint = f"pip install {exc.name.split('.')[0]}"
        if not hint and info.distribution:
            hint = f"reinstall {info.distribution}"
        raise BackendImportError(
            f"storage backend {info.name!r} ({info.target}) failed to import: {exc}. "
            f"Install hint: {hint or 'install the package that provides ' + module_name}"
        ) from exc
    except AttributeError as exc:
        raise BackendImportError(
            f"storage backend {info.name!r}: module {module_name!r} has no attribute {attr!r} "
            f"(registered target {info.target!r})"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, StorageBackend)):
        raise BackendImportError(
            f"storage backend {info.name!r}: {info.target!r} is {obj!r}, not a tiered.storage.StorageBackend subclass"
        )
    return obj


def get_backend_class(name: str) -> type[StorageBackend]:
    """The class registered under `name`, importing it on first use."""
    with _lock:
        cached = _classes.get(name)
    if cached is not None:
        return cached
    info = known_backends().get(name)
    if info is None:
        raise _not_found(name)
    cls = _import_target(info)
    with _lock:
        _classes[name] = cls
    return cls


def spec_host_buffer_bytes(spec: dict[str, Any] | str | StorageBackend) -> int:
    """The host buffers a backend opened from `spec` holds of its own
    (`StorageBackend.host_buffer_bytes`); imports its plugin, as opening it would. An open
    backend (a wrapper's adopted inner one) answers from its own spec."""
    if isinstance(spec, StorageBackend):
        return type(spec).host_buffer_bytes({k: v for k, v in spec.spec().items() if k != "type"})
    options = _parse_spec(spec)
    return get_backend_class(options.pop("type")).host_buffer_bytes(options)


def _constructor_params(cls: type) -> tuple[list[str], list[str], bool]:
    """(accepted keyword names, required names, takes **kwargs) of ``cls.__init__``."""
    sig = inspect.signature(cls.__init__)  # type: ignore[misc]  # the class's own signature, self first
    accepted: list[str] = []
    required: list[str] = []
    var_kw = False
    for i, (pname, p) in enumerate(sig.parameters.items()):
        if i == 0:  # self
            continue
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            accepted.append(pname)
            if p.default is p.empty:
                required.append(pname)
    return accepted, required, var_kw


def _parse_spec(spec: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"backend spec {spec!r} is not valid JSON: {exc}") from exc
            return _parse_spec(parsed)
        return {"type": text}
    if not isinstance(spec, dict):
        raise ConfigError(
            f"backend spec must be a dict like {{'type': 'nvme', 'path': ...}} or a name, got {spec!r}"
        )
    if "type" not in spec:
        raise ConfigError(
            f"backend spec {spec!r} has no 'type' key; add e.g. 'type': 'nvme' (known: {', '.join(known_backends())})"
        )
    return dict(spec)


def open_backend(spec: dict[str, Any] | str, *, bridge: IOBridge | None = None) -> StorageBackend:
    """Construct a backend from ``{"type": name, **constructor_kwargs}`` or a bare name.

    A key the constructor does not take is a ConfigError naming it, the nearest accepted key and
    all accepted keys; so is a missing required one. `bridge`, if given, is the `IOBridge` the
    backend's blocking calls go through (see [Note: one I/O bridge]); else the default one.
    """
    kwargs = _parse_spec(spec)
    name = kwargs.pop("type")
    cls = get_backend_class(name)
    accepted, required, var_kw = _constructor_params(cls)
    if not var_kw:
        for key in kwargs:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"backend {name!r}: unknown option {key!r}.{hint} "
                    f"Accepted options: {', '.join(accepted) or '(none)'}"
                )
    missing = [r for r in required if r not in kwargs]
    if missing:
        raise ConfigError(
            f"backend {name!r}: missing required option(s) {', '.join(map(repr, missing))}; "
            f"e.g. {{'type': {name!r}, {missing[0]!r}: ...}}"
        )
    backend = cls(**kwargs)
    if backend.name != name:  # the spec's type ([Note: lazy backend registry])
        backend.name = name  # type: ignore[misc]  # an instance's registry name shadows the class default
    if bridge is not None:
        backend.use_bridge(bridge)
    return backend
