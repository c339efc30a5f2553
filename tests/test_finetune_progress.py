"""`tiered finetune`'s progress: a tqdm bar with loss, tokens/s, ETA and per-link GB/s on a
terminal, the plain step lines anywhere else ([Note: progress output])."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from finetune_support import ds_config, write_jsonl, write_model

from tiered.cli.finetune import finetune_job
from tiered.cli.finetune.options import FinetuneOptions
from tiered.finetune.loop import StepLog
from tiered.finetune.progress import BarProgress, LineProgress, make_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_choice_follows_isatty() -> None:
    assert isinstance(make_progress(io.StringIO(), 3), LineProgress)
    bar = make_progress(Terminal(), 3)
    assert isinstance(bar, BarProgress)
    bar.close()


def test_bar_shows_step_loss_rate_and_links() -> None:
    term = Terminal()
    bar = BarProgress(term, 4)
    bar.step(StepLog(2, 1.25, 1e-3, 1234.0, 0.5, {"cpu->gpu": 1.5, "gpu->cpu": 0.0}))
    bar.eval(2, 1.5, 7)
    bar.close()
    text = term.getvalue()
    assert "2/4" in text and "loss 1.2500" in text and "1,234 tok/s" in text
    assert "cpu->gpu 1.50 GB/s" in text and "gpu->cpu" not in text  # idle links are left out
    assert "eval      2  loss 1.5000  (7 rows)" in text


def test_finetune_on_a_terminal_draws_the_bar(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the fast place {i} is small."} for i in range(30)])
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(tmp_path / "nvme")))
    term = Terminal()
    job = finetune_job(
        FinetuneOptions(model_path=model, config=cfg, data_path=data, seq_len=16, steps=3, eval_fraction=0.2),
        term,
    )
    text = term.getvalue()
    assert job.result.steps_done == 3
    assert "3/3" in text and "tok/s" in text and "GB/s" in text  # nvme offload: links moved bytes
    assert "step     1/3" not in text  # no plain lines on a terminal
    assert "eval      3  loss" in text


def test_bar_draws_on_a_terminal_that_reports_no_width(monkeypatch: pytest.MonkeyPatch) -> None:
    # a pty nobody sized (script(1), CI) reports 0 x 0: the bar must still show its fields (tqdm
    # asks the screen size of sys.stdout itself, so the pty stands in for it)
    import os
    import pty
    import sys

    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as term:
            assert os.get_terminal_size(term.fileno()).columns == 0
            monkeypatch.setattr(sys, "stdout", term)
            bar = BarProgress(term, 4)
            bar.step(StepLog(2, 1.25, 1e-3, 1234.0, 0.5, {}))
            bar.close()
        text = _drain(master)
    finally:
        os.close(master)
        os.close(slave)
    assert "2/4" in text and "loss 1.2500" in text


def _drain(fd: int) -> str:
    """Everything written to the pty so far: a pty's master hands it out in pieces."""
    import os
    import select

    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()
