"""NVMe-resident state is copied file to file in bounded chunks ([Note: checkpoint chunk
pipeline]): a save or load of a partition much larger than a chunk grows the RSS by a few
chunks, not by the partition; a corrupt swap file fails the save; tiny chunks that cut the
resharded pieces anywhere still give every byte back."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from checkpoint_support import train
from engine_support import CASES, MLP, build, ds_config, make_batches

import tiered
from tiered.checkpoint import engine_state, read_latest, read_parameters
from tiered.errors import StorageCorruptError

CHUNK = 4 << 20


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _drop_cached_buffers(e: tiered.Engine) -> None:
    # the host tiers keep freed buffers for reuse ([Note: size-class buffer pool]); training left
    # partition-sized ones there, which would hide what a save or load allocates itself
    for name in e.tm.tier_names:
        pool = getattr(e.tm.tier(name).backend, "pool", None)
        if pool is not None:
            pool.clear()


def _peak_growth(fn: object) -> int:
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _vm_kib("VmRSS")
    fn()  # type: ignore[operator]
    return (_vm_kib("VmHWM") - base) * 1024


def _one_big_group(tmp_path: Path, features: tuple[int, int]) -> tuple[nn.Module, dict[str, object]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(*features, bias=False))  # one ~64 MiB partition per kind
    config = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), sub_group_size=1 << 26)
    # the partitions streamed file to file: on NVMe only, none kept in memory ([Note: residency])
    config["tiered"] = {"residency": "off"}
    return model, config


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "features",
    [(4096, 4096), (4001, 4000)],
    ids=["blocks", "odd-size"],  # 16,004,032 fp32 elements: the swap file ends in block padding
)
def test_save_and_load_of_a_partition_far_larger_than_a_chunk_grow_rss_by_a_few_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, features: tuple[int, int]
) -> None:
    monkeypatch.setattr(engine_state, "CHUNK_BYTES", CHUNK)
    model, config = _one_big_group(tmp_path, features)
    with tiered.initialize(model, config) as e:
        e.backward(e(torch.randn(2, features[0])).square().mean())
        e.step()
        e.flush()
        on_nvme_only = [
            p for p in e.tm.partitions() if p.valid_in() == {p.home} and p.home.startswith("nvme")
        ]
        largest = max(p.nbytes for p in on_nvme_only)
        assert len(on_nvme_only) >= 2 and largest >= 15 * CHUNK  # exp_avg, exp_avg_sq: swap files only
        importlib.import_module("safetensors")  # first imports are not the save's
        _drop_cached_buffers(e)
        saved = _peak_growth(lambda: e.save_checkpoint(tmp_path / "ck"))
        _drop_cached_buffers(e)
        loaded = _peak_growth(lambda: e.load_checkpoint(tmp_path / "ck"))
    print(
        f"rss growth: save {saved / 2**20:.1f} MiB, load {loaded / 2**20:.1f} MiB, partitions {largest >> 20} MiB"
    )
    bound = 5 * CHUNK + (8 << 20)  # the pipeline's 3 buffers, a spare, allocator and interpreter slack
    assert saved <= bound, f"RSS grew by {saved / 2**20:.1f} MiB while saving (bound {bound >> 20} MiB)"
    assert loaded <= bound, f"RSS grew by {loaded / 2**20:.1f} MiB while loading (bound {bound >> 20} MiB)"


def test_a_corrupt_swap_file_fails_the_save_and_latest_stays(tmp_path: Path) -> None:
    case = CASES["mlp"]
    # sub_group_size above the group's 1M elements: its states stay whole, not tiles
    # ([Note: sub-group pipeline]), so each is a 4 MiB partition in a swap file of its own
    config = ds_config(param="cpu", opt="nvme", nvme_path=str(tmp_path / "nvme"), sub_group_size=1 << 21)
    config.setdefault("tiered", {})["residency"] = "off"  # the states in their swap files, not kept in cpu
    torch.manual_seed(0)
    model = MLP(hidden=1024)  # a 4 MiB group: its own swap file (objects <= 1 MiB share the slab)
    with tiered.initialize(model, config) as e:
        train(e, case, make_batches(case, 1, 4))
        first = e.save_checkpoint(tmp_path / "ck", tag="first")
        e.flush()
        backend = e.tm.tier("nvme").backend
        part = next(
            p
            for p in e.tm.partitions()
            if p.name.endswith("exp_avg") and p.valid_in() == {p.home} and backend.local_file(p.name)
        )
        swap = Path(backend.local_file(part.name).path)
        data = bytearray(swap.read_bytes())
        data[len(data) // 2] ^= 0x40
        swap.write_bytes(bytes(data))
        with pytest.raises(StorageCorruptError, match=rf"{part.name}.*{swap.name}.*fails its checksum"):
            e.save_checkpoint(tmp_path / "ck", tag="second")
    assert read_latest(tmp_path / "ck") == "first" and Path(first).is_dir()
    assert not (tmp_path / "ck" / "second").exists()


@pytest.mark.parametrize("chunk", [4096, 12288])
def test_chunks_smaller_than_the_pieces_reshard_bit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Saved from swap files in chunks of a few KB, loaded into other group boundaries (so a
    shard's pieces start and end inside chunks), saved again: every byte of every kind is back."""
    monkeypatch.setattr(engine_state, "CHUNK_BYTES", chunk)
    case = CASES["mlp"]
    first = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme1"), sub_group_size=1000)
    second = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme2"), sub_group_size=3001)
    with tiered.initialize(build(case), first) as e:
        train(e, case, make_batches(case, 2, 4))
        e.flush()
        e.save_checkpoint(tmp_path / "a")
    with tiered.initialize(build(case, seed=3), second) as e:
        e.load_checkpoint(tmp_path / "a")
        e.flush()
        e.save_checkpoint(tmp_path / "b")
        train(e, case, make_batches(case, 1, 4, seed=9))  # and it trains on from the swap files written
    for kind in ("param", "master", "exp_avg", "exp_avg_sq"):
        a, b = read_parameters(tmp_path / "a", kind=kind), read_parameters(tmp_path / "b", kind=kind)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), kind


@pytest.mark.parametrize("write", [True, False])
def test_o_direct_refused_per_call_goes_buffered_for_reads_and_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: bool
) -> None:
    """A filesystem that takes O_DIRECT at open but refuses a call with EINVAL: the chunk copy
    drops O_DIRECT for that fd and moves the unpadded bytes (one fallback for both directions)."""
    import errno
    import os

    from tiered.checkpoint.pipeline import ALIGN, pread_exact, pwrite_all

    name = "pwritev" if write else "preadv"
    real, calls = getattr(os, name), []

    def refuse_once(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append(sum(len(b) for b in bufs))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return int(real(fd, bufs, offset))

    length = ALIGN + 100  # not a whole block: padded while O_DIRECT is on
    path = tmp_path / "f"
    want = bytes(range(256)) * (length // 256) + bytes(length % 256)
    if not write:
        path.write_bytes(want)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    buf = torch.zeros(2 * ALIGN, dtype=torch.uint8)
    if write:
        buf[:length] = torch.frombuffer(bytearray(want), dtype=torch.uint8)
    monkeypatch.setattr(os, name, refuse_once)
    try:
        if write:
            assert pwrite_all(fd, buf, 0, length, direct=True) is False
        else:
            pread_exact(fd, buf, 0, length, direct=True, what="test read")
    finally:
        os.close(fd)
    assert calls[0] == 2 * ALIGN and calls[1] == length  # padded, then the true length
    assert path.read_bytes() == want and bytes(buf[:length].numpy()) == want
