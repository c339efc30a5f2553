"""TierManager.claim_home / commit_home / release_home ([Note: direct home I/O]): a caller's own
I/O on a partition's home file never races a move, a committed file is the newest value with
its digest, a failed commit changes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import xxhash
from tiered_cpu import PinnedCPUBackend
from tiered_nvme import NVMeBackend

from tiered.errors import StorageCorruptError, StorageIOError
from tiered.storage.files import temp_path
from tiered.tiers import Tier, TierManager

N = 4096


def _manager(tmp_path: Path) -> TierManager:
    swap = NVMeBackend(tmp_path / "swap", create=True, atomic=False, fsync=False)
    return TierManager([Tier("cpu", PinnedCPUBackend(pin_memory=False)), Tier("nvme", swap)], timeout_s=30)


def _replacement(tm: TierManager, value: float) -> tuple[Path, int]:
    loc = tm.tier("nvme").backend.local_file("p")
    assert loc is not None
    data = torch.full((N,), value).numpy().tobytes()
    tmp = temp_path(Path(loc.path).parent, "p")
    tmp.write_bytes(data)
    return tmp, xxhash.xxh3_64_intdigest(data)


def test_a_committed_file_is_the_newest_value_and_other_copies_go_stale(tmp_path: Path) -> None:
    with _manager(tmp_path) as tm:
        p = tm.create("p", N, torch.float32, "nvme", init=torch.ones(N))
        tm.fetch(p, "cpu").result()
        tm.release(p, "cpu")  # a clean cpu copy of the old bytes
        assert p.valid_in() == {"cpu", "nvme"}
        claim = tm.claim_home(p, write=True)
        assert claim is not None
        tmp, digest = _replacement(tm, 2.0)
        tm.commit_home(claim, tmp, digest)
        assert not tmp.exists()  # adopted: renamed into place
        assert p.valid_in() == {"nvme"} and p.checksum("nvme") == digest
        got = tm.fetch(p, "cpu").result()  # read back and verified against the new digest
        assert torch.equal(got, torch.full((N,), 2.0))
        tm.release(p, "cpu")


def test_a_wrong_digest_is_caught_by_the_next_read(tmp_path: Path) -> None:
    with _manager(tmp_path) as tm:
        p = tm.create("p", N, torch.float32, "nvme", init=torch.ones(N))
        claim = tm.claim_home(p, write=True)
        assert claim is not None
        tmp, digest = _replacement(tm, 2.0)
        tm.commit_home(claim, tmp, digest ^ 1)
        with pytest.raises(StorageCorruptError, match="checksum mismatch"):
            tm.fetch(p, "cpu").result()


def test_a_failed_commit_keeps_the_old_bytes_and_releases_the_home(tmp_path: Path) -> None:
    with _manager(tmp_path) as tm:
        p = tm.create("p", N, torch.float32, "nvme", init=torch.ones(N))
        before = p.checksum("nvme")
        claim = tm.claim_home(p, write=True)
        assert claim is not None

        tmp, _ = _replacement(tm, 2.0)
        tmp.unlink()  # as if the disk had filled before it was complete

        with pytest.raises(StorageIOError, match=r"adopt_file of key 'p'.*previous object is intact"):
            tm.commit_home(claim, tmp, 123)
        assert p.valid_in() == {"nvme"} and p.checksum("nvme") == before
        assert torch.equal(tm.fetch(p, "cpu").result(), torch.ones(N))
        tm.release(p, "cpu")
        again = tm.claim_home(p, write=True)  # the first claim was released
        assert again is not None
        tm.release_home(again)


def test_a_read_claim_skips_a_stale_home_and_holds_off_write_backs(tmp_path: Path) -> None:
    with _manager(tmp_path) as tm:
        p = tm.create("p", N, torch.float32, "nvme", init=torch.ones(N))
        t = tm.allocate(p, "cpu").result()
        t.fill_(3.0)
        tm.release(p, "cpu")  # dirty in cpu: home is stale
        assert tm.claim_home(p, write=False) is None  # the newest bytes are the cpu copy's
        tm.flush(p).result()
        claim = tm.claim_home(p, write=False)
        assert claim is not None and claim.checksum == p.checksum("nvme")
        t = tm.fetch(p, "cpu").result()  # reads beside a read claim are fine
        t.fill_(4.0)
        tm.mark_dirty(p, "cpu")
        tm.release(p, "cpu")
        flush = tm.flush(p)
        time.sleep(0.3)
        assert not flush.done(), "a write-back replaced the home file while a reader held it"
        tm.release_home(claim)
        flush.result()
        assert p.valid_in() == {"cpu", "nvme"}
