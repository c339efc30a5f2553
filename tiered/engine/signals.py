"""SIGTERM while engines are open: their swap folders removed, then the process ends as killed.

[Note: SIGTERM from a library]
A Ctrl-C (SIGINT) raises KeyboardInterrupt: the stack unwinds, open engines close from
``with`` blocks or at exit ([Note: managers left open at exit]) and their swap folders go. SIGTERM
(what ``kill``, systemd, Slurm and Kubernetes send) kills a Python process at once by default:
gigabytes of swap files stayed behind until the next run reclaimed them. So while an engine is
open, tiered handles SIGTERM, politely, as a library must:

* only where SIGTERM still has its default disposition (``SIG_DFL``): a handler of the program's
  own (tiered finetune's checkpoint-on-SIGTERM, a framework's) or ``SIG_IGN`` is never replaced;
* only from the main thread (Python runs handlers there, and only it may install them); an
  engine made elsewhere leaves SIGTERM alone;
* the handler first gives SIGTERM its default disposition back (a second SIGTERM ends the
  process at once), then closes the tier manager of every open engine (its backends close: swap
  folders are removed; the rest of ``close()`` is skipped, as the handler may run inside a hook or
  a step whose state it would wait on, and the process is going anyway), then sends SIGTERM to the
  process again, so it ends as killed by SIGTERM (status -15 to a parent, 143 in a shell), as it
  would without tiered;
* that close is bounded by ``SIGTERM_CLOSE_S`` for all engines together, not by
  ``tiered.timeout_s`` (600 s): Python runs the handler wherever the main thread was, possibly
  holding a lock the tier manager's loop thread then needs (a logging handler's, while a full
  stderr pipe blocks its write; a condition the stepper notifies). The loop cannot finish the
  close until the main thread returns, which it does not until the close ends: without a short
  bound, ``kill`` left the process waiting minutes. At the bound the process ends anyway, with a
  warning; a swap folder left behind then is reclaimed by the next run here (the owner is dead);
* when the last engine closes, the disposition found is put back, unless someone replaced ours
  in the meantime (then theirs stays).

A program that wants SIGTERM to do something else installs its own handler (before or after
initialize); a program that catches SIGTERM itself should close its engines in it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Any, Protocol

log = logging.getLogger(__name__)


class _Closable(Protocol):
    def close(self, *, timeout_s: float | None = None) -> None: ...


class _WithTiers(Protocol):
    @property
    def tm(self) -> _Closable: ...


_open: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.RLock()  # the handler may close an engine while the main thread holds it
_installed = False


def watch(engine: _WithTiers) -> None:
    """`engine` is open: SIGTERM closes it (installs the handler where the Note allows)."""
    global _installed
    with _lock:
        _open.add(engine)
        if _installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # the program's own handler, or SIG_IGN: not ours to replace
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # an embedded interpreter without signals
            return
        _installed = True


def unwatch(engine: _WithTiers) -> None:
    """`engine` closed; with none left open, SIGTERM gets its default disposition back."""
    global _installed
    with _lock:
        _open.discard(engine)
        if _open or not _installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # someone else's since: keep theirs
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed = False


def sigterm_handled() -> bool:
    """Whether SIGTERM currently closes the open engines (tests, diagnostics)."""
    return signal.getsignal(signal.SIGTERM) is _on_sigterm


SIGTERM_CLOSE_S = 10.0
"""How long SIGTERM's handler waits for the open engines' tiers to close, all together, before the
process ends regardless ([Note: SIGTERM from a library])."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _installed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM now ends the process at once
    _installed = False
    engines = list(_open)
    _say(
        logging.WARNING,
        "SIGTERM: closing %d tiered engine(s) (their swap files are removed), then exiting",
        len(engines),
    )
    end = time.monotonic() + SIGTERM_CLOSE_S
    for e in engines:
        try:  # only the tiers: the handler may run inside a hook or a step, whose state the rest
            # of close() would wait on; closing the backends removes swap files
            e.tm.close(timeout_s=max(0.1, end - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - the process is ending: close the others regardless
            _say(
                logging.WARNING,
                "SIGTERM: a tiered engine's tiers did not close within %.0f s (%s); exiting anyway: "
                "a swap folder left behind is reclaimed by the next run in its directory",
                SIGTERM_CLOSE_S,
                exc,
            )
    os.kill(os.getpid(), signal.SIGTERM)  # now the default: the process ends as killed by SIGTERM


def _say(level: int, msg: str, *args: object) -> None:
    # The signal may have landed inside a logging handler's write: a reentrant write to the same
    # stream raises here, and nothing may keep the handler from closing the tiers and exiting.
    try:
        log.log(level, msg, *args)
    except Exception:  # noqa: BLE001
        pass
