"""How `tiered bench` shows its progress: a live tqdm bar on a terminal, plain lines otherwise
(the same rule as tiered finetune's [Note: progress output]).

The measuring code calls the progress object with one message per unit of work (a method's
round, a replayed step, a tuned setting) and announces how many units it will do with
`add_total`; headings that are not a unit go to `note`. A plain callable (tests, scripts) works
too: `add_total` / `note` are looked up, not required.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

from tiered.terminal import open_bar


def add_total(progress: Callable[[str], None] | None, n: int) -> None:
    fn = getattr(progress, "add_total", None)
    if fn is not None:
        fn(n)


def note(progress: Callable[[str], None] | None, msg: str) -> None:
    fn = getattr(progress, "note", None)
    if fn is not None:
        fn(msg)
    elif progress is not None:
        progress(msg)


class BenchProgress:
    """A tqdm bar when `stream` is a terminal and tqdm imports, else "  message" lines."""

    def __init__(self, stream: TextIO, *, quiet: bool = False, bar: bool | None = None) -> None:
        self._stream, self._quiet = stream, quiet
        self._bar: Any = None
        want = (not quiet) and (stream.isatty() if bar is None else bar)
        if want:
            try:
                self._bar = open_bar(stream, total=0, unit="op")
            except ImportError:  # the bar is optional (tiered[hf] brings tqdm): plain lines then
                self._bar = None

    @property
    def is_bar(self) -> bool:
        return self._bar is not None

    def add_total(self, n: int) -> None:
        if self._bar is not None:
            self._bar.total = (self._bar.total or 0) + n
            self._bar.refresh()

    def note(self, msg: str) -> None:
        if self._quiet:
            return
        if self._bar is not None:
            self._bar.set_description_str(msg[:40])
        else:
            self._line(msg)

    def __call__(self, msg: str) -> None:
        if self._quiet:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(msg[-90:], refresh=False)
            self._bar.update(1)
        else:
            self._line(msg)

    def _line(self, msg: str) -> None:
        self._stream.write(f"  {msg}\n")
        self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
