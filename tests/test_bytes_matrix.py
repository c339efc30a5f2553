"""benchmarks/bytes_matrix.py: step.py's tiered runner in bf16 with two micro-batches a step, its
NVMe bytes next to the formula (issue 22 item 2); bad options refused before anything runs."""

from __future__ import annotations

import json

import pytest
from engine_support import load_benchmark

pytest.importorskip("transformers")

bytes_matrix = load_benchmark("bytes_matrix.py", "bytes_matrix_bench")


@pytest.mark.slow  # ~25 s: two engines of step.py's 35.7M model
def test_bf16_with_accumulation_moves_the_formulas_bytes(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--steps", "2", "--precision", "bf16", "--accumulation", "2", "--nvme-dir", str(tmp_path)]
    assert bytes_matrix.main([*args, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["precision"], r["accumulation"], r["overlap"]) for r in rows] == [
        ("bf16", 2, False),
        ("bf16", 2, True),
    ]
    for r in rows:
        assert r["read_bytes"] > 0 and r["write_bytes"] > 0
        assert r["read_over_formula"] <= 1.05 and r["write_over_formula"] <= 1.05
        assert r["read_over_formula"] >= 0.9 and r["write_over_formula"] >= 0.9
        assert len(r["losses"]) == 2  # a loss per step, each the mean of its two micro-batches
    assert "largest measured / formula" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # its NVMe files are gone


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "1"], "--steps 1 must exceed --warmup 1"),
        (["--accumulation", "0"], "--accumulation [0]"),
        (["--nvme-dir", "/nonexistent/tiered"], "is not a directory"),
    ],
)
def test_bad_options_are_refused_by_name(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        bytes_matrix.main(args)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
