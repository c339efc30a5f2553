"""Partition checksums over pieces ([Note: partition checksums]): the parallel digest equals the
one-thread one, covers every piece in order, and a flip in any piece is still caught."""

from __future__ import annotations

import threading

import pytest
import torch
import xxhash
from tiers_support import three_tier_manager

import tiered.tiers.checksum as checksum
import tiered.tiers.transfer as transfer
from tiered.errors import StorageCorruptError
from tiered.tiers import CopyState


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    """4 KiB pieces, so a partition of a few KiB spans several (the real size is 8 MiB)."""
    monkeypatch.setattr(checksum, "PIECE_BYTES", 4096)
    return 4096


def test_pieces_cover_the_bytes_in_order(small_pieces: int) -> None:
    assert checksum.pieces(0) == [(0, 0)]
    assert checksum.pieces(4096) == [(0, 4096)]
    assert checksum.pieces(10000) == [(0, 4096), (4096, 4096), (8192, 1808)]


def test_digest_of_one_piece_is_plain_xxh3_and_of_several_is_order_sensitive(small_pieces: int) -> None:
    one = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: one piece
    assert checksum.digest_of(one) == xxhash.xxh3_64_intdigest(one.numpy().tobytes())
    t = torch.arange(3000, dtype=torch.float32)  # 12000 bytes: three pieces
    b = t.view(torch.uint8)
    parts = [xxhash.xxh3_64_intdigest(b[o : o + n].numpy().tobytes()) for o, n in checksum.pieces(b.numel())]
    assert checksum.digest_of(t) == checksum.combine(parts)
    assert checksum.combine(parts) != checksum.combine(parts[::-1])
    swapped = torch.cat([t[1024:2048], t[:1024], t[2048:]])  # first two pieces exchanged
    assert checksum.digest_of(swapped) != checksum.digest_of(t)


def test_write_digest_is_hashed_in_pieces_on_the_bridge_and_equals_digest_of(
    tmp_path, small_pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, str]] = []
    real = transfer.piece_digest

    def counted(b: torch.Tensor, offset: int, length: int) -> int:
        calls.append((offset, threading.current_thread().name))
        return real(b, offset, length)

    monkeypatch.setattr(transfer, "piece_digest", counted)
    init = torch.randn(10000)  # 40000 bytes: 10 pieces
    with three_tier_manager(tmp_path, verify=True, cpu_bytes=1 << 20) as m:
        p = m.create("p", 10000, torch.float32, "nvme", init=init)
        assert p.checksum("nvme") == checksum.digest_of(init)
        assert p.checksum("nvme") != xxhash.xxh3_64_intdigest(init.numpy().tobytes())
        assert sorted(o for o, _ in calls) == [o for o, _ in checksum.pieces(40000)]
        assert all("-io" in name for _, name in calls), calls  # off the loop thread
        calls.clear()
        assert torch.equal(m.fetch(p, "cpu").result(timeout=10), init)
        assert len(calls) == 10  # the read is checked piece by piece too


@pytest.mark.parametrize(
    ("numel", "offset"),
    [(10000, 5), (10000, 4096 * 5 + 3), (10000, 39999), (3000, 4096 * 2 + 1)],  # parallel; one call
)
def test_a_flip_in_any_piece_is_caught_before_use(
    tmp_path, small_pieces: int, numel: int, offset: int
) -> None:
    assert (len(checksum.pieces(numel * 4)) > checksum.SERIAL_PIECES) == (numel == 10000)
    init = torch.randn(numel)
    with three_tier_manager(tmp_path, verify=True, cpu_bytes=1 << 20) as m:
        p = m.create("p", numel, torch.float32, "nvme", init=init)
        f = tmp_path / "nvme" / "p"
        data = bytearray(f.read_bytes())
        data[offset] ^= 0x01
        f.write_bytes(bytes(data))
        with pytest.raises(StorageCorruptError, match=r"checksum mismatch reading into tier 'cpu'.*xxh3_64"):
            m.fetch(p, "cpu").result(timeout=10)
        assert p.state("cpu") is CopyState.ABSENT and m.resident_bytes("cpu") == 0
        assert m.stats()["io"]["checksum_failures"] == 1


@pytest.mark.parametrize(
    "nbytes", [0, 1, 4096, checksum.PIECE_BYTES, checksum.PIECE_BYTES + 1, 3 * checksum.PIECE_BYTES + 12345]
)
@pytest.mark.parametrize("chunk", [1 << 20, 5_000_003, 16 << 20])
def test_a_streamed_digest_equals_the_partition_digest(nbytes: int, chunk: int) -> None:
    """A checkpoint copies a partition file to file in chunks that do not line up with the
    digest's pieces; what it computes on the way must be the digest the tier recorded."""
    data = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    h = checksum.StreamingDigest(nbytes)
    for off in range(0, nbytes, chunk):
        h.update(data[off : off + chunk])
    assert h.intdigest() == checksum.digest_of(data)
