"""Issue 23's and issue 37's cases, run by tests/reliability_probe.py (each in a worker subprocess
with a time limit, so a hang is reported, not waited on): none of the quick ones may be "unclear"
(a raw error) or "wrong" (silent bad result, hang, loss), and each gives the class it expects.
The slow ones (savers of one tag racing, kill -9, two finetune runs on one --out) run with
``python tests/reliability_probe.py``."""

from __future__ import annotations

import reliability_probe as probe


def test_every_quick_case_is_clear_or_fine() -> None:
    cases = [c for c in probe.CASES if not c.slow]
    assert len([c for c in cases if c.issue == 23]) >= 30 and len([c for c in cases if c.issue == 37]) >= 60
    results = probe.run_cases(cases)
    bad = [
        f"{r['id']}: {r['got']} (expected {r['expected']}): {r['observed']}"
        for r in results
        if r["got"] != r["expected"]
    ]
    assert not bad, "\n".join(bad)
    assert not [r for r in results if r["got"] in ("unclear", "wrong")]


def test_every_case_names_its_expectation_and_check() -> None:
    ids = [c.id for c in probe.CASES]
    assert len(ids) == len(set(ids))
    for c in probe.CASES:
        assert c.expected in ("clear", "fine") and c.old and c.check, c.id
    assert {c.id for c in probe.CASES if c.slow} == {
        "two-savers-one-tag",
        "partial-folders-after-kill-9",
        "out-two-runs-at-once",
    }


def test_every_case_has_the_class_the_issue_gave_it() -> None:
    assert set(probe.OLD_CLASS) == {c.id for c in probe.CASES if c.issue == 23}
    assert set(probe.OLD_CLASS.values()) <= {"unclear", "wrong"}


def test_every_issue_37_case_has_its_measured_class_before_the_fixes() -> None:
    newer = {c.id for c in probe.CASES if c.issue == 37}
    assert len(newer) >= 60 and set(probe.BEFORE_37) == newer
    assert set(probe.BEFORE_37.values()) <= set(probe.CLASSES)


def test_a_hang_or_a_dead_worker_is_wrong_and_the_next_case_still_runs() -> None:
    def fake(id: str) -> probe.Case:
        return probe.Case(id, "self", "-", "wrong", "-", lambda wd: ("fine", ""), timeout_s=3)

    real = next(c for c in probe.CASES if c.id == "tag-nul")
    got = {r["id"]: r for r in probe.run_cases([fake("selftest-hang"), fake("selftest-crash"), real])}
    assert got["selftest-hang"]["got"] == "wrong" and "hung" in got["selftest-hang"]["observed"]
    assert got["selftest-crash"]["got"] == "wrong" and "exit -9" not in got["selftest-crash"]["observed"]
    assert "the worker died (exit 9)" in got["selftest-crash"]["observed"]
    assert got["tag-nul"]["got"] == "clear"
