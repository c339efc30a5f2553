"""What every reliability probe case shares (tests/reliability_probe.py runs them): the case
registry, the classes, and the helpers that classify what a call did. Issue 23's cases are in
reliability_probe.py, issue 37's (the newer surfaces) in reliability_probe_surfaces.py."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLASSES = ("clear", "fine", "unclear", "wrong")
MARK = "@@PROBE "

Outcome = tuple[str, str]  # (class, what was observed)


@dataclass(frozen=True)
class Case:
    id: str
    group: str
    old: str  # the behaviour issue 23 reported
    expected: str  # the class the fixed code must give
    check: str  # what the probe checks
    fn: Callable[[Path], Outcome]
    slow: bool = False
    timeout_s: float = 60.0
    issue: int = 23
    """The issue that listed the case (23), or whose round of hostile cases it belongs to (37)."""


CASES: list[Case] = []


def case(
    id: str,
    group: str,
    old: str,
    expected: str,
    check: str,
    slow: bool = False,
    timeout_s: float = 60.0,
    issue: int = 23,
) -> Callable[[Callable[[Path], Outcome]], Callable[[Path], Outcome]]:
    def register(fn: Callable[[Path], Outcome]) -> Callable[[Path], Outcome]:
        CASES.append(Case(id, group, old, expected, check, fn, slow, timeout_s, issue))
        return fn

    return register


# ---- helpers ---------------------------------------------------------------------------------
_WORKDIR: list[str] = []  # the running case's folder, written "<tmp>" in what it observed


def _short(msg: str, n: int = 300) -> str:
    """`msg` on one line, the case's folder as <tmp> and digests as <xxh3> (the same text on every
    run), cut to `n` characters."""
    for wd in _WORKDIR:
        msg = msg.replace(wd, "<tmp>")
    msg = re.sub(r"'[0-9a-f]{16}'", "'<xxh3>'", " ".join(msg.split()))
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def raises(
    fn: Callable[[], Any], exc: type[BaseException] | tuple[type[BaseException], ...], *subs: str
) -> Outcome:
    """ "clear" when `fn()` raises `exc` whose message holds every one of `subs`; "unclear" for
    another exception or a message missing one of them; "wrong" when it returns."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [s for s in subs if s not in msg]
        if missing:
            return "unclear", f"{type(e).__name__} without {missing}: {_short(msg)}"
        return "clear", f"{type(e).__name__}: {_short(msg)}"
    except MemoryError as e:
        return "wrong", f"ran out of memory (the worker's address-space limit): {_short(str(e))}"
    except Exception as e:  # noqa: BLE001 - a raw error is what the probe classifies
        return "unclear", f"raw {type(e).__name__}: {_short(str(e))}"
    return "wrong", "accepted silently"


class _Absent(Exception):
    """An error class the code under test does not define (an older tree): never raised, so
    whatever is raised instead is "unclear"."""


def error_class(name: str) -> type[BaseException]:
    """tiered.errors.`name`, or `_Absent` where this tree has none (the probe runs on old trees
    too, to measure what they did)."""
    import tiered.errors

    found = getattr(tiered.errors, name, None)
    return found if isinstance(found, type) and issubclass(found, BaseException) else _Absent


def also(outcome: Outcome, *checks: tuple[bool, str]) -> Outcome:
    """`outcome` unless one of `checks` (ok, what it says when not ok) failed: then "wrong"."""
    bad = [why for ok, why in checks if not ok]
    return ("wrong", f"{outcome[1]}; but {'; '.join(bad)}") if bad else outcome


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> Warnings:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)

    def has(self, *subs: str) -> bool:
        return any(all(s in m for s in subs) for m in self.messages)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "plugins"), str(HERE), env.get("PYTHONPATH", "")]
    )
    return env


WORKER_MEMORY_BYTES = 8 << 30
"""The address space a worker may use: a case that reads /dev/zero or builds a model without end
meets MemoryError there, not the machine's OOM killer."""


def cli(argv: list[str]) -> tuple[int | None, str, str, BaseException | None]:
    """`tiered ARGV` run in this process: (exit status, stdout, stderr, the exception that escaped
    main: a traceback the user would see)."""
    import contextlib
    import io

    from tiered.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            return main(argv), out.getvalue(), err.getvalue(), None
        except BaseException as e:  # noqa: BLE001 - what escapes is what the probe classifies
            return None, out.getvalue(), err.getvalue(), e


def cli_refuses(argv: list[str], *subs: str, status: int = 2) -> Outcome:
    """ "clear" when `tiered ARGV` exits `status` with a one-line error holding every one of
    `subs`; "unclear" for a traceback or a message missing one; "wrong" when it exits 0 or runs
    out of memory."""
    rc, out, err, exc = cli(argv)
    if isinstance(exc, MemoryError):
        return "wrong", f"ran out of memory (the worker's address-space limit): {_short(str(exc))}"
    if exc is not None:
        return "unclear", f"traceback: {type(exc).__name__}: {_short(str(exc))}"
    said = [ln for ln in err.splitlines() if "error:" in ln]
    line = said[-1] if said else (err.strip().splitlines() or [""])[-1]
    if rc == 0:
        return "wrong", f"exit 0: accepted{'; ' + _short(line) if line else ''}"
    missing = [s for s in subs if s not in line]
    if rc != status or missing:
        return "unclear", f"exit {rc}{f' without {missing}' if missing else ''}: {_short(line)}"
    return "clear", f"exit {rc}: {_short(line)}"


def as_nobody(fn: Callable[[], Outcome]) -> Outcome:
    """`fn()` as it goes for a user who is not root (hostile_support.as_other_user: as root, in a
    forked child that gave up root for uid/gid 65534 first); the outcome comes back as JSON."""
    import json

    from hostile_support import as_other_user

    text = as_other_user(lambda: json.dumps(list(fn())))
    if not text:
        return "unclear", "the unprivileged child reported nothing"
    if text.startswith("raw "):
        return "unclear", _short(text)
    got, observed = json.loads(text)
    return got, observed + (" (as uid 65534)" if os.geteuid() == 0 else "")
