"""Fault rules: the validated, JSON-round-tripping form of a faults backend's ``"faults"`` list.

[Note: fault triggers]
Every rule except ``enospc`` counts the operations it matches (its ``op`` and, if given, the
``key`` glob): the k-th match after the first ``after`` ones fires when ``k`` is in ``nth``, when
``k`` is a multiple of ``every``, with probability ``probability`` (a generator of the rule's own,
seeded from the backend's ``seed`` and the rule's index, so one rule's draws never shift
another's), or, with none of the three, on every match; ``max_fires`` caps how often it fires.
Counting happens when an operation starts, in call order, so a run that issues the same
operations in the same order injects the same faults. ``enospc`` instead counts bytes: a write
that would take the bytes written (``count: "written"``) or stored (``count: "stored"``, deletes
and overwrites give space back) past ``after_bytes`` fails.
"""

from __future__ import annotations

import difflib
import errno as errno_mod
import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiered.errors import ConfigError
from tiered.units import parse_bytes

OPS = ("read", "write", "delete", "exists")
TRIGGER_KEYS = ("op", "key", "nth", "every", "probability", "after", "max_fires")

# kind -> (keys it accepts besides "kind", ops it may name, whether "op" is required)
_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "error": (TRIGGER_KEYS + ("errno",), OPS, True),
    "delay": (TRIGGER_KEYS + ("delay_s",), OPS, False),
    "hang": (TRIGGER_KEYS, OPS + ("close",), True),  # a close that hangs: a dead mount at the end
    "enospc": (("key", "after_bytes", "count"), ("write",), False),
    "torn_write": (
        tuple(k for k in TRIGGER_KEYS if k != "op")
        + ("mode", "keep_fraction", "keep_bytes", "sector_bytes", "errno"),
        ("write",),
        False,
    ),
    "bitflip": (TRIGGER_KEYS + ("bits", "offset", "bit"), ("read", "write"), True),
}
FAULT_KINDS = tuple(_KINDS)
TORN_MODES = ("error", "silent")
ENOSPC_COUNTS = ("written", "stored")


def nearest(word: str, choices: Sequence[str]) -> str:
    """' Did you mean X?' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class FaultRule:
    """One entry of ``"faults"``. Fields left at their defaults are left out of `to_json`."""

    kind: str
    ops: tuple[str, ...] = OPS
    key: str | None = None
    nth: tuple[int, ...] | None = None
    every: int | None = None
    probability: float | None = None
    after: int = 0
    max_fires: int | None = None
    errno: int = errno_mod.EIO
    delay_s: float = 0.0
    after_bytes: int = 0
    count: str = "written"
    mode: str = "error"
    keep_fraction: float = 0.5
    keep_bytes: int | None = None
    sector_bytes: int = 512
    bits: int = 1
    offset: int | None = None
    bit: int = 0
    given: tuple[str, ...] = field(default=(), compare=False)
    """The option names the spec gave (so `to_json` writes back exactly those)."""

    def matches(self, op: str, key: str) -> bool:
        return op in self.ops and (self.key is None or fnmatch.fnmatchcase(key, self.key))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for name in self.given:
            if name == "op":
                out["op"] = self.ops[0] if len(self.ops) == 1 else list(self.ops)
            elif name == "nth":
                assert self.nth is not None
                out["nth"] = self.nth[0] if len(self.nth) == 1 else list(self.nth)
            elif name == "errno":
                out["errno"] = errno_mod.errorcode.get(self.errno, self.errno)
            else:
                out[name] = getattr(self, name)
        return out

    def describe(self, index: int) -> str:
        return f"faults[{index}] (kind {self.kind!r})"


def parse_errno(value: Any, where: str) -> int:
    """An errno from a name ("EIO", "ENOSPC") or a number the errno module knows."""
    if isinstance(value, str):
        code = getattr(errno_mod, value.upper(), None)
        if isinstance(code, int) and value.upper() in errno_mod.errorcode.values():
            return code
        raise ConfigError(
            f"{where}.errno: {value!r} is not an errno name.{nearest(value.upper(), list(errno_mod.errorcode.values()))} "
            "Use a name such as 'EIO', 'EAGAIN' or 'ENOSPC'"
        )
    if isinstance(value, int) and not isinstance(value, bool) and value in errno_mod.errorcode:
        return value
    raise ConfigError(f"{where}.errno: expected an errno name such as 'EIO' or its number, got {value!r}")


def _count(value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _fraction(value: Any, where: str, *, open_low: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (0.0 < value if open_low else 0.0 <= value) or value > 1.0:
        low = "(0" if open_low else "[0"
        raise ConfigError(f"{where}: expected a number in {low}, 1], got {value!r}")
    return float(value)


def _parse_ops(value: Any, kind: str, allowed: tuple[str, ...], where: str) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{where}.op: expected one of {', '.join(allowed)} (or a list of them), got {value!r}"
        )
    if names == ["any"] and set(OPS) <= set(allowed):
        return OPS  # the data operations; a close is named
    for n in names:
        if n not in allowed:
            raise ConfigError(
                f"{where}.op: {n!r} is not an operation a {kind!r} fault applies to.{nearest(n, allowed)} "
                f"Choose from {', '.join(allowed)}" + (" or 'any'" if set(OPS) <= set(allowed) else "")
            )
    return tuple(dict.fromkeys(names))


def parse_rule(raw: Any, index: int) -> FaultRule:
    """Validate one ``"faults"`` entry; ConfigError naming ``faults[index].<option>``."""
    where = f"faults[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{where}: expected a dict like {{'kind': 'error', 'op': 'read', 'nth': 3}}, got {raw!r}"
        )
    kind = raw.get("kind")
    if kind not in _KINDS:
        if kind is None:
            raise ConfigError(f"{where}: missing 'kind'; one of {', '.join(FAULT_KINDS)}")
        raise ConfigError(
            f"{where}: unknown fault kind {kind!r}.{nearest(str(kind), FAULT_KINDS)} Kinds: {', '.join(FAULT_KINDS)}"
        )
    accepted, allowed_ops, op_required = _KINDS[kind]
    for name in raw:
        if name != "kind" and name not in accepted:
            raise ConfigError(
                f"{where}: unknown option {name!r} for a {kind!r} fault.{nearest(name, accepted)} "
                f"Accepted: kind, {', '.join(accepted)}"
            )
    if op_required and "op" not in raw:
        raise ConfigError(f"{where}: a {kind!r} fault needs 'op' (one of {', '.join(allowed_ops)})")
    v: dict[str, Any] = {"kind": kind, "given": tuple(n for n in raw if n != "kind")}
    v["ops"] = _parse_ops(raw["op"], kind, allowed_ops, where) if "op" in raw else allowed_ops
    if "key" in raw:
        if not isinstance(raw["key"], str) or not raw["key"]:
            raise ConfigError(
                f"{where}.key: expected a key or a glob such as '*.exp_avg_sq', got {raw['key']!r}"
            )
        v["key"] = raw["key"]
    triggers = [n for n in ("nth", "every", "probability") if n in raw]
    if len(triggers) > 1:
        raise ConfigError(f"{where}: give at most one of nth, every, probability (got {', '.join(triggers)})")
    if "nth" in raw:
        nth = raw["nth"] if isinstance(raw["nth"], list) else [raw["nth"]]
        if not nth:
            raise ConfigError(f"{where}.nth: expected a count >= 1 or a list of them, got []")
        v["nth"] = tuple(sorted({_count(n, f"{where}.nth", minimum=1) for n in nth}))
    if "every" in raw:
        v["every"] = _count(raw["every"], f"{where}.every", minimum=1)
    if "probability" in raw:
        v["probability"] = _fraction(raw["probability"], f"{where}.probability")
    if "after" in raw:
        v["after"] = _count(raw["after"], f"{where}.after", minimum=0)
    if "max_fires" in raw:
        v["max_fires"] = _count(raw["max_fires"], f"{where}.max_fires", minimum=1)
    if "errno" in raw:
        v["errno"] = parse_errno(raw["errno"], where)
    if kind == "delay":
        if "delay_s" not in raw:
            raise ConfigError(f"{where}: a 'delay' fault needs 'delay_s' (seconds, > 0)")
        d = raw["delay_s"]
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d <= 0:
            raise ConfigError(f"{where}.delay_s: expected seconds > 0, got {d!r}")
        v["delay_s"] = float(d)
    if kind == "enospc":
        if "after_bytes" not in raw:
            raise ConfigError(f"{where}: an 'enospc' fault needs 'after_bytes' (e.g. 1048576 or '1GiB')")
        v["after_bytes"] = parse_bytes(raw["after_bytes"], what=f"{where}.after_bytes")
        if "count" in raw:
            if raw["count"] not in ENOSPC_COUNTS:
                raise ConfigError(
                    f"{where}.count: {raw['count']!r} is not one of {', '.join(ENOSPC_COUNTS)}."
                    f"{nearest(str(raw['count']), ENOSPC_COUNTS)}"
                )
            v["count"] = raw["count"]
    if kind == "torn_write":
        _parse_torn(raw, where, v)
    if kind == "bitflip":
        _parse_bitflip(raw, where, v)
    return FaultRule(**v)


def _parse_torn(raw: Mapping[str, Any], where: str, v: dict[str, Any]) -> None:
    if "mode" in raw:
        if raw["mode"] not in TORN_MODES:
            raise ConfigError(
                f"{where}.mode: {raw['mode']!r} is not one of {', '.join(TORN_MODES)}.{nearest(str(raw['mode']), TORN_MODES)}"
            )
        v["mode"] = raw["mode"]
    if "keep_fraction" in raw and "keep_bytes" in raw:
        raise ConfigError(f"{where}: give keep_fraction or keep_bytes, not both")
    if "keep_fraction" in raw:
        v["keep_fraction"] = _fraction(raw["keep_fraction"], f"{where}.keep_fraction")
    if "keep_bytes" in raw:
        v["keep_bytes"] = parse_bytes(raw["keep_bytes"], what=f"{where}.keep_bytes")
    if "sector_bytes" in raw:
        v["sector_bytes"] = _count(raw["sector_bytes"], f"{where}.sector_bytes", minimum=1)
    if "errno" in raw and v.get("mode", "error") == "silent":
        raise ConfigError(
            f"{where}.errno: a 'silent' torn write raises nothing; drop errno or use mode 'error'"
        )


def _parse_bitflip(raw: Mapping[str, Any], where: str, v: dict[str, Any]) -> None:
    if "bits" in raw:
        v["bits"] = _count(raw["bits"], f"{where}.bits", minimum=1)
    if "offset" in raw:
        v["offset"] = _count(raw["offset"], f"{where}.offset", minimum=0)
        if v.get("bits", 1) != 1:
            raise ConfigError(f"{where}: with 'offset' one bit is flipped (that byte's 'bit'); drop 'bits'")
    if "bit" in raw:
        if "offset" not in raw:
            raise ConfigError(f"{where}.bit: names a bit of the byte at 'offset'; give 'offset' too")
        b = raw["bit"]
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 7:
            raise ConfigError(f"{where}.bit: expected 0..7, got {b!r}")
        v["bit"] = b


def parse_faults(raw: Any) -> tuple[FaultRule, ...]:
    """The ``"faults"`` list of a faults spec, validated."""
    if raw is None:
        return ()
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"faults: expected a list of fault dicts, got {raw!r}")
    return tuple(parse_rule(r, i) for i, r in enumerate(raw))
