"""[Note: backward waits instead of parking]: the admission of a kept gradient waits only while
the stepper has kept gradients to consume and the tier has no room for it without a write-back;
it never waits with none pending; its wait is bounded; the cpu tier evicts kept gradients last,
the most recently flushed first. (The engine-level check, every group step consumed from memory
with a cpu tier of no spare room, is in tests/test_bytes_per_step.py.)"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from engine_support import (
    CASES,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    make_batches,
    reference_train,
    tiered_train,
)

from tiered.errors import TierTimeoutError
from tiered.optim.kept_grads import KeptGrads, KeptLastPolicy
from tiered.tiers import CopyState


@dataclass
class Part:
    """What the keeper and its policy read of a partition."""

    name: str
    nbytes: int = 100
    home: str = "nvme"
    dirty: bool = True
    used_at: int = 0

    def state(self, tier: str) -> CopyState:
        return CopyState.DIRTY if self.dirty else CopyState.VALID

    def last_use(self, tier: str) -> int:
        return self.used_at


@dataclass
class FakeTM:
    """A cpu tier of `budget` bytes whose clean room is `room` (what `KeptGrads` asks of it)."""

    budget: int | None
    room: int
    policy: Any = None
    asked: list[str] = field(default_factory=list)

    def budget_bytes(self, tier: str) -> int | None:
        return self.budget

    def partitions(self) -> list[Part]:
        return []

    def set_eviction_policy(self, tier: str, policy: Any) -> None:
        self.policy = policy

    def clean_room_bytes(self, tier: str) -> int | None:
        self.asked.append(tier)
        return self.room


def _keeper(tm: FakeTM, staging: int = 0, timeout_s: float = 60.0) -> KeptGrads:
    return KeptGrads(tm, "cpu", staging, timeout_s)  # type: ignore[arg-type]


def _admit_in_thread(kept: KeptGrads, part: Part) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            kept.admit(part)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_nothing_pending_never_waits_even_with_no_room() -> None:
    """A single group, or a gradient whose group waits for the ranks' verdict: no kept gradient
    was handed to the stepper, so nothing will free room; the flush proceeds as before."""
    tm = FakeTM(budget=100, room=0)
    kept = _keeper(tm, staging=100)
    kept.begin_step()
    kept.kept(Part("g0"))  # kept but never queued (not handed to the stepper)
    kept.admit(Part("g1"))  # type: ignore[arg-type]
    assert kept.stats()["backward_waits"] == 0
    assert tm.asked == []  # not even a question to the manager


def test_a_stopped_stepper_is_not_waited_for() -> None:
    tm = FakeTM(budget=100, room=0)
    kept = _keeper(tm, staging=100)
    kept.begin_step()
    g0 = Part("g0")
    kept.kept(g0)  # type: ignore[arg-type]
    kept.queued(g0)  # type: ignore[arg-type]
    kept.end_step()  # the stepper failed or finished
    kept.admit(Part("g1"))  # type: ignore[arg-type]
    assert kept.stats()["backward_waits"] == 0


def test_room_without_a_write_back_admits_at_once() -> None:
    tm = FakeTM(budget=1000, room=500)
    kept = _keeper(tm, staging=200)
    kept.begin_step()
    g0 = Part("g0")
    kept.kept(g0)  # type: ignore[arg-type]
    kept.queued(g0)  # type: ignore[arg-type]
    kept.admit(Part("g1"))  # type: ignore[arg-type]
    assert kept.stats()["backward_waits"] == 0 and tm.asked == ["cpu"]


@pytest.mark.parametrize("short", ["room", "allowance"])
def test_a_flush_waits_until_the_stepper_consumes_a_kept_gradient(short: str) -> None:
    """No clean room for it (or the kept gradients at their allowance: budget less the pipeline's
    bound): the flush waits; the step of a kept gradient frees room and lets it through."""
    tm = FakeTM(budget=1000, room=0 if short == "room" else 1000)
    kept = _keeper(tm, staging=850 if short == "allowance" else 0)  # allowance 150: one kept
    kept.begin_step()
    g0, g1 = Part("g0"), Part("g1")
    kept.kept(g0)  # type: ignore[arg-type]
    kept.queued(g0)  # type: ignore[arg-type]
    t, errors = _admit_in_thread(kept, g1)
    t.join(0.2)
    assert t.is_alive(), f"admitted without room: {errors}"
    tm.room = 1000
    kept.stepped(g0, from_memory=True)  # type: ignore[arg-type]
    t.join(30)
    assert not t.is_alive() and not errors, errors
    stats = kept.stats()
    assert stats["backward_waits"] == 1 and stats["backward_wait_s"] > 0
    assert stats["parked_group_steps"] == 0


def test_the_wait_is_bounded_by_timeout_s_and_names_the_gradient() -> None:
    tm = FakeTM(budget=100, room=0)
    kept = _keeper(tm, staging=0, timeout_s=0.05)
    kept.begin_step()
    g0 = Part("g0")
    kept.kept(g0)  # type: ignore[arg-type]
    kept.queued(g0)  # type: ignore[arg-type]
    with pytest.raises(TierTimeoutError, match=r"'g1\.grad'.*tiered\.timeout_s.*1 kept gradients"):
        kept.admit(Part("g1.grad"))  # type: ignore[arg-type]


def test_a_kept_gradient_read_from_home_counts_as_parked() -> None:
    kept = _keeper(FakeTM(budget=None, room=0))
    kept.begin_step()
    g0 = Part("g0", nbytes=64)
    kept.kept(g0)  # type: ignore[arg-type]
    kept.stepped(g0, from_memory=False)  # type: ignore[arg-type]
    kept.stepped(Part("never-kept"), from_memory=False)  # type: ignore[arg-type]
    assert kept.stats()["parked_group_steps"] == 1 and kept.stats()["parked_bytes"] == 128


def test_the_cpu_tier_evicts_clean_copies_first_and_the_next_gradient_to_step_last() -> None:
    tm = FakeTM(budget=1000, room=0)
    kept = _keeper(tm)
    assert isinstance(tm.policy, KeptLastPolicy)
    grads = [Part(f"g{i}", used_at=i) for i in range(3)]  # flushed in this order: g0 steps next
    for g in grads:
        kept.kept(g)  # type: ignore[arg-type]
    other_dirty, clean = Part("param", used_at=9), Part("state", dirty=False, used_at=10)
    order = tm.policy.choose("cpu", [*grads, other_dirty, clean], 100)
    assert [p.name for p in order] == ["state", "param", "g2", "g1", "g0"]


@pytest.mark.parametrize(("gas", "clip"), [(1, 0.05), (2, 0.0)], ids=["clipping", "accumulation"])
def test_nothing_is_kept_where_the_step_reads_gradients_from_home(
    tmp_path: Any, gas: int, clip: float
) -> None:
    """Clipping (the global norm first) and accumulation keep the round trip through NVMe: no
    keeper is made, so no flush is ever held back."""
    case = CASES["mlp"]
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), gas=gas, clip=clip)
    cfg["tiered"] = {"grad_tier": "nvme", "overlap_step_with_backward": True}
    _, _, stats = tiered_train(build(case), case, make_batches(case, steps=2, micro=4, gas=gas), cfg)
    assert stats["optimizer"]["grad_parked"] == {}
    assert stats["optimizer"]["grad_consumed_from_memory"]["group_steps"] == 0


def test_training_with_no_spare_cpu_room_equals_plain_adamw(tmp_path: Any) -> None:
    """A cpu tier of 64 KiB (this model's pipeline bound) where backward ran ahead of the stepper
    and parked about two thirds of the kept gradients: every group step now consumes its gradient
    from memory, and the training equals plain PyTorch AdamW."""
    case = CASES["llama"]
    batches = make_batches(case, steps=3, micro=4)
    ref_losses, ref_state = reference_train(build(case), case, batches, lr=1e-3)
    cfg = ds_config(
        param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), cpu_budget="64KiB", buffer_count=2
    )
    cfg["tiered"].update({"grad_tier": "nvme", "overlap_step_with_backward": True})
    losses, state, stats = tiered_train(build(case), case, batches, cfg)
    opt = stats["optimizer"]
    assert opt["grad_consumed_from_memory"]["group_steps"] == 3 * opt["groups_cpu"], opt
    assert opt["grad_parked"]["parked_group_steps"] == 0, opt["grad_parked"]
    assert_losses_close(losses, ref_losses)
    assert_params_close(state, ref_state, rel=1e-5)
