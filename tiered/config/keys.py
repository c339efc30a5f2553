"""Every configuration key tiered recognises, and what it does with each one.

[Note: key classification]
Each key of a DeepSpeed or tiered config falls in exactly one class:

- ``supported``: mapped into the resolved `TieredConfig` and read by the engine.
- ``accepted``: parsed and validated exactly as DeepSpeed does (so the resolved config and
  `dump_config` keep it), but with no effect in tiered, for the reason listed; logged once at
  INFO. These are knobs of DeepSpeed machinery that tiered replaces by its own.
- ``ignored``: accepted and ignored *only* because it cannot change results by design — a logging
  or profiling switch for a logger tiered does not have, a knob of a DeepSpeed code path that
  tiered does not have (its effect is subsumed by tiered's own machinery), or a choice between
  implementations of the same math. Each is listed below with the reason, and the loader logs it
  at INFO once per process.
- ``default_only``: recognised; accepted only at a value that means "feature off" (listed in
  `allowed`), because tiered does not implement the feature. Any other value raises
  `UnsupportedConfigError` saying so and what to do.
- ``unsupported_if_enabled``: a whole DeepSpeed section (``elasticity``, ``pipeline``...) tiered
  does not implement. Present with ``"enabled": false`` (or no ``enabled``) it is ignored, and
  its inner keys are not checked; enabled, it raises `UnsupportedConfigError`.
  Ignored *sections* (the loggers, ``activation_checkpointing``) are likewise accepted whole,
  without checking their inner keys: they configure code tiered does not have, so a typo inside
  them cannot change what tiered does.
- ``section``: a nested object whose keys are classified by their own rows.
- ``reported``: a feature tiered does not have whose switch cannot change what is trained (a
  logger, a profiler): accepted whole, and when it is turned on (``"enabled": true``, or any
  setting for a key without one) a WARNING once names the key and says that it has no effect.
- keys starting with ``_`` (``"_comment"``) are comments at any depth and are skipped. (DeepSpeed
  skips them at the top level, where it ignores every unknown key; its sections are pydantic
  models that refuse them. A comment cannot change training, so tiered skips them everywhere.)
- anything else is unknown: `ConfigError` naming the full key path and either the section it
  belongs to (a known key in the wrong section: "aio belongs at the top level") or the nearest
  valid key.

Stages: tiered partitions parameters in every ZeRO stage. ``zero_optimization.stage`` 0, 1 and
2 run on the same machinery as stage 3 (on one GPU the stages differ only in what is sharded
across ranks, and tiered's partitions are its unit of offload); the stage is kept in
`ZeroConfig.stage` for reporting and for DeepSpeed's stage-dependent rules (offload_param needs
stage 3; overlap_comm defaults to true only for stage 3).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import sys
from collections.abc import Iterable
from typing import Any

from tiered.config.auto import HIDDEN_SIZE_FORMULAS
from tiered.config.declare import KeyDecl, declared_fields, field_default
from tiered.config.key_rules import UNDECLARED_RULES, KeyRule
from tiered.config.schema import TieredConfig
from tiered.errors import ConfigError, UnsupportedConfigError

log = logging.getLogger(__name__)


def _declared() -> dict[str, tuple[dataclasses.Field[Any], KeyDecl]]:
    """Every spelling of every key declared on a schema field ([Note: one declaration per key])."""
    out: dict[str, tuple[dataclasses.Field[Any], KeyDecl]] = {}
    for _, f, decl in declared_fields(TieredConfig):
        for name in decl.names:
            out[f"{decl.section}.{name}" if decl.section else name] = (f, decl)
    return out


DECLARED = _declared()


def _declared_rule(path: str, decl: KeyDecl) -> KeyRule:
    if path != decl.path and decl.kind == "supported":
        return KeyRule(path, decl.kind, f"alias of {decl.names[0]}")
    note = decl.doc
    if decl.auto == "model":
        note += f'; "auto": {HIDDEN_SIZE_FORMULAS[decl.path][0]} (H: the model\'s hidden size)'
    return KeyRule(path, decl.kind, note)


_ALL_RULES = (*UNDECLARED_RULES, *(_declared_rule(path, decl) for path, (_, decl) in DECLARED.items()))
RULES: dict[str, KeyRule] = {rule.path: rule for rule in _ALL_RULES}
if len(RULES) != len(_ALL_RULES):
    raise AssertionError(
        "a config key is both declared on a schema field and listed in key_rules.UNDECLARED_RULES"
    )
_CHILDREN: dict[str, list[str]] = {}
for _rule in _ALL_RULES:
    _parent, _, _leaf = _rule.path.rpartition(".")
    _CHILDREN.setdefault(_parent, []).append(_leaf)

_logged_ignored: set[str] = set()
_warned: set[str] = set()


def known_keys(section_path: str) -> list[str]:
    """Keys valid directly under `section_path` ("" is the top level)."""
    return list(_CHILDREN.get(section_path, ()))


def _join(section_path: str, key: str) -> str:
    return f"{section_path}.{key}" if section_path else key


_COMMENT_WORDS = frozenset({"comment", "comments", "note", "notes", "description", "doc", "remark"})


def is_comment(key: Any) -> bool:
    """A "_comment"-style key: skipped at any depth (see [Note: key classification])."""
    return isinstance(key, str) and key.startswith("_")


def _home_of(key: str, section_path: str) -> str | None:
    """Where a known key found in the wrong section belongs ("the top level", "zero_optimization")."""
    homes = [r.path.rpartition(".")[0] for r in _ALL_RULES if r.path.rpartition(".")[2] == key]
    homes = sorted(h for h in homes if h != section_path)
    if not homes or len(homes) > 2:  # a generic leaf ("enabled", "type") points nowhere useful
        return None
    return " or ".join("the top level" if h == "" else repr(h) for h in homes)


def unknown_key_error(section_path: str, key: str, valid: Iterable[str]) -> ConfigError:
    """ConfigError for an unknown key, naming its full path and where it belongs or the nearest valid key."""
    valid = list(valid)
    path = _join(section_path, key)
    home = _home_of(key, section_path)
    if home is not None:
        where = f'"{key}": {{...}}' if RULES.get(key, KeyRule("", "supported")).kind == "section" else key
        return ConfigError(
            f"configuration key {path!r} is in the wrong section: {key} belongs at {home}; move {where} there"
        )
    if key.strip().lower() in _COMMENT_WORDS:
        return ConfigError(
            f'unknown configuration key {path!r}; keys starting with "_" are comments: write "_{key}"'
        )
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {_join(section_path, close[0])!r}?"
    else:
        hint = f"valid keys here: {', '.join(sorted(valid))}"
    return ConfigError(f"unknown configuration key {path!r}; {hint}")


def check_section(section: dict[str, Any], section_path: str) -> None:
    """Classify every key of `section`: raise for unknown or unsupported ones, log ignored ones.

    Supported and accepted keys and sub-sections are left for the caller to read.
    """
    valid = known_keys(section_path)
    for key, value in section.items():
        if is_comment(key):
            continue
        path = _join(section_path, key)
        rule = RULES.get(path)
        if rule is None:
            raise unknown_key_error(section_path, key, valid)
        if rule.kind in ("ignored", "accepted"):
            _log_ignored(rule)
        elif rule.kind == "reported":
            _report(rule, value)
        elif rule.kind == "default_only":
            if not any(_same(value, ok) for ok in rule.allowed):
                raise UnsupportedConfigError(
                    f"{path} = {value!r} is recognised but not supported by tiered: {rule.note}"
                )
        elif rule.kind == "unsupported_if_enabled":
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a JSON object {{...}}, got {value!r}")
            where = _switched_on(value, path, on_when_present=rule.path in _ON_WHEN_PRESENT)
            if where is not None:
                raise UnsupportedConfigError(
                    f"{where} is enabled, which tiered does not support: {rule.note}; "
                    f'remove the {path} section or set "enabled": false'
                )
            _log_ignored(rule, "disabled section of an unsupported feature")


_ON_WHEN_PRESENT = frozenset({"sparse_attention"})
"""Sections DeepSpeed switches on by their presence (it has no "enabled" key for them)."""


def _switched_on(section: dict[str, Any], path: str, *, on_when_present: bool) -> str | None:
    """The section that turns an unsupported feature on, or None: an "enabled" that is not
    false at any depth (DeepSpeed's compression_training enables each method in a nested
    ``shared_parameters.enabled``), or, for a section DeepSpeed enables by presence, any setting
    unless its own "enabled" is false. Walked without recursion: configs may be deep."""
    if on_when_present and section.get("enabled", True) not in (False, None):
        if any(not is_comment(k) for k in section):
            return path
    stack = [(path, section)]
    while stack:
        where, node = stack.pop()
        for k, v in node.items():
            if is_comment(k):
                continue
            if k == "enabled" and v not in (False, None):
                return where
            if isinstance(v, dict):
                stack.append((f"{where}.{k}", v))
    return None


def _report(rule: KeyRule, value: Any) -> None:
    """WARNING once for a switched-on feature tiered does not have; INFO when it is off."""
    if isinstance(value, dict):
        on = value.get("enabled", any(not is_comment(k) for k in value)) not in (False, None)
    else:
        on = value not in (False, None)
    if not on:
        _log_ignored(rule, f"off here; {rule.note}")
        return
    if rule.path in _warned:
        return
    _warned.add(rule.path)
    log.warning(
        "config key %r accepted and ignored, but it is set and has no effect in tiered: %s",
        rule.path,
        rule.note,
    )


def _same(value: Any, allowed: Any) -> bool:
    # JSON has no int/bool distinction problem in Python: True == 1, so compare types for bools.
    if isinstance(allowed, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(allowed, bool) and value == allowed
    if isinstance(allowed, (int, float)) and isinstance(value, str):
        try:
            return float(value) == allowed
        except ValueError:
            return False
    return bool(value == allowed)


def _log_ignored(rule: KeyRule, reason: str | None = None) -> None:
    if rule.path in _logged_ignored:
        return
    _logged_ignored.add(rule.path)
    log.info("config key %r accepted and ignored: %s", rule.path, reason or rule.note)


def ignored_keys_table() -> list[tuple[str, str]]:
    """(key path, reason) for every accepted-and-ignored key, for docs and `tiered plan`."""
    return [
        (r.path, r.note)
        for r in _ALL_RULES
        if r.kind in ("ignored", "accepted", "reported", "unsupported_if_enabled")
    ]


_CLASS_NAMES: dict[str, str] = {
    "supported": "honoured",
    "accepted": "accepted, no effect",
    "ignored": "ignored",
    "reported": "reported when set",
    "default_only": "only its 'off' value",
    "unsupported_if_enabled": "refused when enabled",
    "section": "section",
}


def _default_text(path: str) -> str:
    if path not in DECLARED:
        return ""
    f, decl = DECLARED[path]
    if decl.default_doc:
        return decl.default_doc
    value = field_default(f)
    if value == sys.maxsize:
        return "sys.maxsize"
    return "`" + json.dumps(list(value) if isinstance(value, tuple) else value) + "`"


def markdown_table() -> str:
    """docs/config.md's "Every key" table, generated from the rules and the schema's
    declarations (tests/test_config_declared.py checks the file holds exactly this)."""
    source = (
        *(r for r in _ALL_RULES if r.path in DECLARED),
        *UNDECLARED_RULES,
    )  # declared first in a section
    children: dict[str, list[KeyRule]] = {}
    for rule in source:
        children.setdefault(rule.path.rpartition(".")[0], []).append(rule)
    rules: list[KeyRule] = []

    def walk(parent: str) -> None:  # a section's own rows, then each of its sub-sections'
        rules.extend(children.get(parent, ()))
        for rule in children.get(parent, ()):
            if rule.path in children:
                walk(rule.path)

    walk("")
    lines = ["| key | class | default | what tiered does |", "|---|---|---|---|"]
    for r in rules:
        what = r.note
        if r.kind == "default_only":
            what = f"accepted at {', '.join(repr(v) for v in r.allowed)}; otherwise refused: {r.note}"
        lines.append(f"| `{r.path}` | {_CLASS_NAMES[r.kind]} | {_default_text(r.path)} | {what} |")
    return "\n".join(lines) + "\n"
