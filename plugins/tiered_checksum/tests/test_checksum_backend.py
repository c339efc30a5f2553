"""The checksum backend: conformance over a file and a memory backend, corruption caught on read
(bit flip, truncation, a missing or damaged digest) with the key and both digests named, digests
across a reopen, nested specs, and a training tier through it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from tiered_checksum import ChecksumBackend
from tiered_checksum.backend import sidecar_key

import tiered
from tiered.errors import ConfigError, StorageCorruptError, StorageKeyError, StoredSizeError
from tiered.storage import open_backend
from tiered.storage.base import MAX_KEY_CHARS
from tiered.testing import BackendConformance, random_bytes


class TestChecksumOverNVMeConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return ChecksumBackend(inner={"type": "nvme", "path": str(tmp_path)})


class TestChecksumOverCPUConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return ChecksumBackend(inner={"type": "cpu"})


def _file_of(root: Path, key: str) -> Path:
    (hit,) = [f for f in root.rglob("*") if f.is_file() and f.name.startswith(key) and ".xxh3" not in f.name]
    return hit


def _run(coro):
    return asyncio.run(coro)


def test_a_flipped_bit_is_an_error_naming_key_and_both_digests(tmp_path: Path) -> None:
    async def main() -> None:
        spec = {"type": "checksum", "inner": {"type": "nvme", "path": str(tmp_path)}}
        b = open_backend(spec)
        data = random_bytes(1 << 20, seed=1)
        await b.write("g0001.param", data)
        await b.close()
        f = _file_of(tmp_path, "g0001.param")
        raw = bytearray(f.read_bytes())
        raw[12345] ^= 0x10
        f.write_bytes(bytes(raw))
        reopened = open_backend(spec)  # a new process would see the same: the digest is on disk
        try:
            with pytest.raises(
                StorageCorruptError,
                match=r"g0001\.param.*xxh3_64 0x[0-9a-f]{16} read, 0x[0-9a-f]{16} written",
            ):
                await reopened.read("g0001.param", torch.empty_like(data))
            assert reopened.stats()["mismatches"] == 1
        finally:
            await reopened.close()

    _run(main())


def test_clean_reads_across_a_reopen_are_verified(tmp_path: Path) -> None:
    async def main() -> None:
        spec = {"type": "checksum", "inner": {"type": "nvme", "path": str(tmp_path)}}
        b = open_backend(spec)
        data = random_bytes(3 << 20, seed=2)
        await b.write("k", data)
        await b.close()
        reopened = open_backend(spec)
        out = torch.empty_like(data)
        await reopened.read("k", out)
        assert torch.equal(out, data)
        assert reopened.stats() == {"verified_bytes": data.numel(), "mismatches": 0}
        await reopened.close()

    _run(main())


def test_truncated_object_is_corruption_not_a_size_misuse(tmp_path: Path) -> None:
    async def main() -> None:
        spec = {"type": "checksum", "inner": {"type": "nvme", "path": str(tmp_path)}}
        b = open_backend(spec)
        data = random_bytes(1 << 20, seed=3)
        await b.write("cut", data)
        await b.close()
        f = _file_of(tmp_path, "cut")
        f.write_bytes(f.read_bytes()[: (1 << 19)])
        reopened = open_backend(spec)
        try:
            with pytest.raises(StorageCorruptError, match=r"'cut'.*truncated.*1048576 bytes were written"):
                await reopened.read("cut", torch.empty_like(data))
            # a caller passing the wrong size is still told so, with both sizes (API misuse)
            with pytest.raises(StoredSizeError, match="1048576"):
                await reopened.read("cut", torch.empty(100, dtype=torch.uint8))
        finally:
            await reopened.close()

    _run(main())


def test_an_object_without_a_digest_is_not_trusted(tmp_path: Path) -> None:
    async def main() -> None:
        inner = open_backend({"type": "nvme", "path": str(tmp_path)})
        await inner.write("foreign", random_bytes(4096, seed=4))
        await inner.close()
        b = open_backend({"type": "checksum", "inner": {"type": "nvme", "path": str(tmp_path)}})
        try:
            with pytest.raises(StorageCorruptError, match=r"'foreign'.*no recorded digest"):
                await b.read("foreign", torch.empty(4096, dtype=torch.uint8))
            with pytest.raises(StorageKeyError, match="'absent' not found"):
                await b.read("absent", torch.empty(4, dtype=torch.uint8))
        finally:
            await b.close()

    _run(main())


def test_a_damaged_digest_is_corruption(tmp_path: Path) -> None:
    async def main() -> None:
        spec = {"type": "checksum", "inner": {"type": "nvme", "path": str(tmp_path)}}
        b = open_backend(spec)
        await b.write("d", random_bytes(4096, seed=5))
        await b.close()
        (side,) = [f for f in tmp_path.rglob("*") if f.is_file() and f.name.startswith(sidecar_key("d"))]
        side.write_bytes(side.read_bytes()[:5])
        reopened = open_backend(spec)
        try:
            with pytest.raises(StorageCorruptError, match=r"digest of key 'd'.*damaged"):
                await reopened.read("d", torch.empty(4096, dtype=torch.uint8))
        finally:
            await reopened.close()

    _run(main())


def test_longest_key_has_a_digest_and_delete_removes_both(tmp_path: Path) -> None:
    async def main() -> None:
        b = ChecksumBackend(inner={"type": "nvme", "path": str(tmp_path)})
        key = "k" * MAX_KEY_CHARS
        data = random_bytes(5000, seed=6)
        await b.write(key, data)
        out = torch.empty_like(data)
        await b.read(key, out)
        assert torch.equal(out, data)
        assert len(sidecar_key(key)) <= MAX_KEY_CHARS
        await b.delete(key)
        assert not await b.exists(key)
        assert not [f for f in tmp_path.rglob("*") if f.is_file()], "delete leaves no digest behind"
        await b.close()

    _run(main())


def test_spec_errors_name_the_place() -> None:
    with pytest.raises(ConfigError, match="missing required option.*'inner'"):
        open_backend({"type": "checksum", "iner": {"type": "cpu"}})
    with pytest.raises(ConfigError, match="unknown option 'innr'.*Did you mean 'inner'"):
        open_backend({"type": "checksum", "inner": "cpu", "innr": {"type": "cpu"}})
    with pytest.raises(ConfigError, match=r"backend 'checksum' option 'inner'.*unknown option 'pth'"):
        open_backend({"type": "checksum", "inner": {"type": "nvme", "pth": "x"}})
    b = open_backend({"type": "checksum", "inner": {"type": "faults", "inner": "cpu"}})
    assert b.spec()["inner"]["type"] == "faults"
    assert not b.capabilities.memory_like
    asyncio.run(b.close())


def test_training_through_a_checksum_tier_detects_a_flipped_optimizer_state(tmp_path: Path) -> None:
    """The layer as a declared tier: training runs through it, and a bit flipped in the stored
    optimizer state between steps stops the next step with the key named."""
    from torch import nn

    store = tmp_path / "store"
    store.mkdir()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        },
        "tiered": {
            "tiers": {
                "safe": {"backend": {"type": "checksum", "inner": {"type": "nvme", "path": str(store)}}}
            },
            "optimizer_tier": "safe",
            "verify_checksums": False,  # only the layer checks, so the test sees its own error
            "residency": "off",  # each step reads the state back through the layer, not from memory
        },
    }

    def step(engine) -> None:
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()

    with tiered.initialize(model, config) as engine:
        step(engine)
        engine.flush()  # the write-backs reach the store
        links = engine.stats()["tiers"]["links"]
        assert any("safe" in k and v["bytes"] > 0 for k, v in links.items())
        victims = [
            f for f in store.rglob("*") if f.is_file() and "exp_avg_sq" in f.name and ".xxh3" not in f.name
        ]
        assert victims, sorted(f.name for f in store.rglob("*"))
        raw = bytearray(victims[0].read_bytes())
        raw[len(raw) // 2] ^= 0x01
        with open(victims[0], "r+b") as fh:  # in place, as a bad sector would
            fh.write(bytes(raw))
            fh.flush()
            os.fsync(fh.fileno())
        with pytest.raises(StorageCorruptError, match="corrupt"):
            step(engine)
