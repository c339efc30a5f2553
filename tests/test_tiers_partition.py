"""Partition's transitions: the one writer's vocabulary, idempotent where a state is set."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tiered.tiers import CopyState, Partition

_LOOP = asyncio.new_event_loop()


def teardown_module() -> None:
    _LOOP.close()


def _fut() -> asyncio.Future[None]:
    return _LOOP.create_future()


def _created(home: str = "nvme") -> Partition:
    p = Partition("p", 16, torch.float32, home)
    p.start_load(home, _fut())
    p.end_load(home, p.version)
    p.moves.end(home)
    return p


def test_a_load_that_raced_a_writer_ends_stale_and_one_that_did_not_ends_valid():
    p = _created()
    assert p.start_load("gpu", _fut()) is False and p.state("gpu") is CopyState.LOADING
    assert p.moves.busy("gpu") is not None
    started = p.version
    p.end_load("gpu", started)
    assert p.state("gpu") is CopyState.VALID
    p.moves.end("gpu")
    p.moves.end("gpu")  # idempotent
    assert p.moves.busy("gpu") is None

    p.start_load("cpu", _fut())
    p.wrote("gpu")  # a writer moved on during the copy
    p.end_load("cpu", started)
    assert p.state("cpu") is CopyState.STALE, "an older copy must never be marked valid"


def test_a_write_stales_every_other_copy_and_clears_home_checksum():
    p = _created()
    p.set_checksum("nvme", 123)
    p.start_load("cpu", _fut())
    p.end_load("cpu", p.version)
    p.moves.end("cpu")
    v = p.version
    stale = p.wrote("gpu")
    assert p.version == v + 1
    assert stale == ["cpu"], "home goes stale but is never freed; other valid copies are returned to free"
    assert (p.state("gpu"), p.state("cpu"), p.state("nvme")) == (
        CopyState.DIRTY,
        CopyState.STALE,
        CopyState.STALE,
    )
    assert p.checksum("nvme") is None
    assert p.valid_in() == frozenset({"gpu"}) and p.dirty_in() == frozenset({"gpu"})


def test_write_back_cleans_every_copy_only_if_no_writer_moved_on():
    p = _created()
    p.start_load("gpu", _fut())
    p.moves.end("gpu")
    p.wrote("gpu")
    v = p.version
    p.wrote("gpu")
    p.written_back(v)  # started before the second write: changes nothing
    assert p.state("nvme") is CopyState.STALE and p.state("gpu") is CopyState.DIRTY
    p.written_back(p.version)
    p.written_back(p.version)  # idempotent
    assert p.state("nvme") is CopyState.VALID and p.state("gpu") is CopyState.VALID


def test_eviction_claims_only_a_free_copy_and_restores_on_failure():
    p = _created()
    p.start_load("gpu", _fut())
    p.end_load("gpu", p.version)
    p.moves.end("gpu")
    p.pin("gpu", +1, tick=1)
    assert not p.can_free("gpu") and p.last_use("gpu") == 1
    p.pin("gpu", -1, tick=2)
    p.moves.add_reader("gpu")
    assert not p.can_free("gpu")
    p.moves.drop_reader("gpu")
    assert p.can_free("gpu") and not p.can_free("nvme"), "home is never evicted"
    prev = p.claim_eviction("gpu", _fut())
    assert prev is CopyState.VALID and p.state("gpu") is CopyState.EVICTING
    assert p.moves.eviction_version("gpu") == p.version
    p.end_eviction("gpu", prev)  # the delete failed
    p.moves.end("gpu")
    assert p.state("gpu") is CopyState.VALID and p.moves.eviction_version("gpu") is None
    with pytest.raises(AssertionError, match="would go negative"):
        p.pin("gpu", -1, tick=3)
