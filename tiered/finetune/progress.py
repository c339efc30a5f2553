"""How `tiered finetune` shows its progress: a live tqdm bar on a terminal, plain lines otherwise.

[Note: progress output]
On a terminal (the output stream's `isatty()`) and with tqdm importable, one bar shows the
step, loss, lr, tokens/s, the ETA (tqdm's, from the step rate) and the GB/s of each link that
moved bytes since the previous update; eval losses are written above the bar. Anywhere else
(a pipe, a file, CI) the output is the plain `step N/M  loss ...` lines, every --log-every
steps, as before: logs stay greppable. Both get the same StepLog values.
"""

from __future__ import annotations

from typing import Any, Protocol, TextIO

from tiered.finetune.loop import StepLog
from tiered.terminal import open_bar


class Progress(Protocol):
    def step(self, s: StepLog) -> None: ...

    def eval(self, step: int, loss: float, rows: int) -> None: ...

    def close(self) -> None: ...


class LineProgress:
    """Plain lines, one per logged step ([Note: progress output])."""

    def __init__(self, out: TextIO, steps: int) -> None:
        self._out, self._steps = out, steps

    def step(self, s: StepLog) -> None:
        self._out.write(
            f"step {s.step:>5}/{self._steps}  loss {s.loss:.4f}  lr {s.lr:.3g}  "
            f"{s.tokens_per_s:,.0f} tokens/s\n"
        )
        self._out.flush()

    def eval(self, step: int, loss: float, rows: int) -> None:
        self._out.write(f"eval  {step:>5}/{self._steps}  loss {loss:.4f}  ({rows} rows)\n")
        self._out.flush()

    def close(self) -> None:
        pass


class BarProgress:
    """A tqdm bar on a terminal ([Note: progress output])."""

    def __init__(self, out: TextIO, steps: int) -> None:
        self._bar: Any = open_bar(out, total=steps, unit="step")
        self._out = out
        self._done = 0

    def step(self, s: StepLog) -> None:
        links = "  ".join(f"{k} {v:.2f} GB/s" for k, v in s.link_gbps.items() if v > 0)
        self._bar.set_postfix_str(
            f"loss {s.loss:.4f}  lr {s.lr:.3g}  {s.tokens_per_s:,.0f} tok/s"
            + (f"  {links}" if links else ""),
            refresh=False,
        )
        self._bar.update(s.step - self._done)
        self._done = s.step

    def eval(self, step: int, loss: float, rows: int) -> None:
        self._bar.write(f"eval  {step:>5}  loss {loss:.4f}  ({rows} rows)", file=self._out)

    def close(self) -> None:
        self._bar.close()


def make_progress(out: TextIO, steps: int) -> Progress:
    """A bar when `out` is a terminal and tqdm is installed, else plain lines."""
    isatty = getattr(out, "isatty", None)
    if callable(isatty) and isatty():
        try:
            return BarProgress(out, steps)
        except ImportError:
            pass
    return LineProgress(out, steps)
