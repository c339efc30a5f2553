"""The stripe backend: conformance with 1 and 3 members and odd stripe sizes, the layout on the
members, atomicity across members, capacity and capabilities, spec errors."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from tiered_nvme import NVMeBackend
from tiered_stripe import StripeBackend
from tiered_stripe.layout import home_member, object_stripe_bytes, record_key, stripe_key, stripes

from tiered.errors import BackendNotFoundError, ConfigError, StorageIOError, StorageKeyError
from tiered.storage import open_backend
from tiered.testing import BackendConformance, random_bytes


def _dirs(tmp_path: Path, n: int) -> list[str]:
    out = []
    for i in range(n):
        d = tmp_path / f"drive{i}"
        d.mkdir(exist_ok=True)
        out.append(str(d))
    return out


class TestStripeOneMemberConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return StripeBackend(paths=_dirs(tmp_path, 1))


class TestStripeThreeMembersConformance(BackendConformance):
    """Durable nvme members (fsync, atomic) and the default stripe size."""

    def make_backend(self, tmp_path):
        return StripeBackend(paths=_dirs(tmp_path, 3))


class TestStripeOddStripeConformance(BackendConformance):
    """An odd, unaligned stripe size: every stripe boundary lands mid-page."""

    def make_backend(self, tmp_path):
        return StripeBackend(
            paths=_dirs(tmp_path, 3), stripe_bytes=1_000_003, member_options={"fsync": False}
        )


class TestStripeTinyStripeMixedMembersConformance(BackendConformance):
    """Many small stripes (4097 B) over a memory member and a file member."""

    def make_backend(self, tmp_path):
        return StripeBackend(
            members=[{"type": "cpu"}, {"type": "nvme", "path": _dirs(tmp_path, 1)[0], "fsync": False}],
            stripe_bytes=4097 * 64,
        )


SWAP = {"atomic": False, "fsync": False, "swap": True}  # how the engine opens its swap tiers


class TestStripeScratchMembersConformance(BackendConformance):
    """Members in the engine's swap mode: the set rewrites unchanged layouts in place
    ([Note: stripe scratch mode]) and still passes the atomic same-key and cancel checks."""

    def make_backend(self, tmp_path):
        return StripeBackend(paths=_dirs(tmp_path, 2), member_options=SWAP, stripe_bytes=1 << 16)


def _run(coro):
    return asyncio.run(coro)


# ---- layout -------------------------------------------------------------------------------
def test_stripes_land_round_robin_from_the_home_member(tmp_path: Path) -> None:
    dirs = [Path(d) for d in _dirs(tmp_path, 3)]
    data = random_bytes(10 * 4096 + 7, seed=1)  # 3 stripes of 16 KiB (N/3 rounded up to a page)

    async def main() -> None:
        async with StripeBackend(paths=[str(d) for d in dirs], stripe_bytes=1000) as b:
            await b.write("obj", data)
            rec = b._records["obj"]
            assert rec.stripe_bytes == 4 * 4096, "one stripe per member, cut on a page"
            home = home_member("obj", 3)
            assert (dirs[home] / record_key("obj")).is_file()
            for i in range(3):
                f = dirs[(home + i) % 3] / stripe_key("obj", rec.generation, i)
                want = data[i * 16384 : (i + 1) * 16384].numpy().tobytes()
                assert f.read_bytes() == want, f"stripe {i}"
            assert not (dirs[home] / stripe_key("obj", rec.generation, 3)).exists()
            sizes = [sum(p.stat().st_size for p in d.iterdir() if p.name.startswith("d")) for d in dirs]
            assert sum(sizes) == data.numel() and min(sizes) > 0  # every member holds a share

    _run(main())


@pytest.mark.parametrize(
    ("nbytes", "stripe_bytes", "members", "want"),
    [
        (64 << 20, 8 << 20, 2, 32 << 20),  # one stripe per member
        (64 << 20, 48 << 20, 2, 48 << 20),  # stripe_bytes larger than the share: it wins
        (10_007, 1 << 20, 3, 1 << 20),  # at most stripe_bytes: whole on its home member
        (3 * 4096 + 1, 1, 3, 2 * 4096),  # the share rounded up to a page: 2 stripes, not 4
        (0, 4096, 2, 4096),
    ],
)
def test_object_stripe_size_is_one_stripe_per_member_at_least_stripe_bytes(
    nbytes: int, stripe_bytes: int, members: int, want: int
) -> None:
    size = object_stripe_bytes(nbytes, stripe_bytes, members)
    assert size == want
    assert len(stripes(nbytes, size, members, 0)) <= members


def test_one_member_is_that_member_alone(tmp_path: Path) -> None:
    (d,) = _dirs(tmp_path, 1)
    t = random_bytes(12_345, seed=2)

    async def main() -> None:
        async with StripeBackend(paths=[d], stripe_bytes=100) as b:
            assert b.capabilities == NVMeBackend(d).capabilities
            await b.write("plain", t)
        assert sorted(p.name for p in Path(d).iterdir()) == ["plain"]  # no record, no stripe names
        async with NVMeBackend(d) as n:  # the files are the nvme backend's own
            out = torch.empty_like(t)
            await n.read("plain", out)
            assert torch.equal(out, t)
        async with StripeBackend(members=[{"type": "cpu"}]) as mem:
            assert mem.capabilities.memory_like
            x = mem.allocate("r", 10, torch.float32)
            x.fill_(3.0)
            assert mem.view("r").data_ptr() == x.data_ptr()

    _run(main())


def test_stripes_move_concurrently(tmp_path: Path) -> None:
    # four members that each take 0.3 s per write: a 4-stripe object takes ~0.3 s, not 1.2 s
    slow = {"kind": "delay", "op": "write", "delay_s": 0.3, "key": "d*"}
    members = [{"type": "faults", "inner": {"type": "cpu"}, "faults": [slow]} for _ in range(4)]
    # distinct specs per member (the stripe set refuses one spec twice): a different seed each
    for i, m in enumerate(members):
        m["seed"] = i

    async def main() -> None:
        async with StripeBackend(members=members, stripe_bytes=1 << 16) as b:
            t0 = time.perf_counter()
            await b.write("four", random_bytes(4 << 16, seed=3))
            elapsed = time.perf_counter() - t0
            assert all(m.stats()["injected"]["delay"] == 1 for m in b.members)
            assert elapsed < 0.9, f"4 stripes took {elapsed:.2f} s: they were not moved concurrently"

    _run(main())


# ---- atomicity across members -------------------------------------------------------------
def test_a_failed_stripe_write_keeps_the_old_object_and_leaves_no_stripes(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 3)
    # 3 stripes over 3 members: 1 stripe write per member per object; each member's 2nd fails
    fail_second = [{"kind": "error", "op": "write", "key": "d*", "nth": 2, "errno": "EIO"}]
    members = [{"type": "faults", "inner": {"type": "nvme", "path": d}, "faults": fail_second} for d in dirs]
    old, new = random_bytes(30_000, seed=4), random_bytes(30_000, seed=5)

    async def main() -> None:
        async with StripeBackend(members=members, stripe_bytes=1000) as b:
            await b.write("k", old)
            names_before = sorted(p.name for d in dirs for p in Path(d).iterdir())
            with pytest.raises(
                StorageIOError,
                match=r"write of key 'k' stripe [0-2] .*on member \d \('faults'\).*injected EIO",
            ) as info:
                await b.write("k", new)
            assert info.value.errno == 5  # the member's errno survives the added context
            assert sum(m.stats()["injected"]["error"] for m in b.members) == 3
            out = torch.empty_like(old)
            await b.read("k", out)
            assert torch.equal(out, old)
            names_after = sorted(p.name for d in dirs for p in Path(d).iterdir())
            assert names_after == names_before, "a failed write left stripes behind"
            await b.write("k", new)  # nothing wedged: the next write goes through
            await b.read("k", out)
            assert torch.equal(out, new)

    _run(main())


# ---- scratch mode: in place over scratch members ---------------------------------------------
def _member_files(dirs: list[str]) -> dict[str, int]:
    """Every file under the member directories, by path, with its inode."""
    return {str(p): p.stat().st_ino for d in dirs for p in sorted(Path(d).rglob("*")) if p.is_file()}


def test_scratch_members_make_an_unchanged_layout_rewrite_in_place(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 2)
    versions = [random_bytes(3 << 20, seed=20 + i) for i in range(3)]

    async def main() -> None:
        async with StripeBackend(paths=dirs, member_options={"atomic": False, "fsync": False}) as b:
            assert b.atomic is False  # follows the members
            await b.write("w", versions[0])
            gen, files = b._records["w"].generation, _member_files(dirs)
            for v in versions[1:]:
                await b.write("w", v)
                assert b._records["w"].generation == gen, "a same-layout write took a new generation"
                assert _member_files(dirs) == files, "a same-layout write made or renamed files"
                out = torch.empty_like(v)
                await b.read("w", out)
                assert torch.equal(out, v)
            await b.write("w", random_bytes(5 << 20, seed=29))  # another size: a fresh generation
            assert b._records["w"].generation != gen
        async with StripeBackend(paths=dirs) as durable:
            assert durable.atomic is True  # atomic members: the commit per write, as before
        async with StripeBackend(paths=dirs, member_options={"atomic": False}, atomic=True) as kept:
            await kept.write("a", versions[0])
            gen = kept._records["a"].generation
            await kept.write("a", versions[1])
            assert kept._records["a"].generation != gen  # "atomic": true keeps a generation per write

    _run(main())


def test_a_failed_in_place_write_drops_the_key_instead_of_keeping_a_mix(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 2)
    fail_second = [{"kind": "error", "op": "write", "key": "d*", "nth": 2, "errno": "EIO"}]
    members = [
        {"type": "faults", "inner": {"type": "nvme", "path": dirs[0], **SWAP}, "faults": fail_second},
        {"type": "nvme", "path": dirs[1], **SWAP},
    ]
    old, new = random_bytes(1 << 20, seed=21), random_bytes(1 << 20, seed=22)

    async def main() -> None:
        async with StripeBackend(members=members, stripe_bytes=4096, atomic=False) as b:
            await b.write("torn", old)
            with pytest.raises(StorageIOError, match=r"write of key 'torn' stripe \d .*injected EIO"):
                await b.write("torn", new)  # member 1's stripe lands, member 0's fails: a mix
            with pytest.raises(StorageKeyError, match=r"key 'torn' not found"):
                await b.read("torn", torch.empty_like(new))
            assert not await b.exists("torn")
            await b.write("torn", new)  # a fresh generation, whole
            out = torch.empty_like(new)
            await b.read("torn", out)
            assert torch.equal(out, new)

    _run(main())


def test_a_cancelled_in_place_write_finishes_every_stripe_before_it_returns(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 2)
    slow = [{"kind": "delay", "op": "write", "key": "d*", "delay_s": 0.3}]
    members = [
        {"type": "faults", "inner": {"type": "nvme", "path": dirs[0], **SWAP}, "faults": slow},
        {"type": "nvme", "path": dirs[1], **SWAP},
    ]
    old, new = random_bytes(1 << 20, seed=23), random_bytes(1 << 20, seed=24)

    async def main() -> None:
        async with StripeBackend(members=members, stripe_bytes=4096, atomic=False) as b:
            await b.write("c", old)
            task = asyncio.ensure_future(b.write("c", new))
            await asyncio.sleep(0.05)  # member 1's stripe is written, member 0's is in its delay
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            out = torch.empty_like(new)
            await b.read("c", out)
            assert torch.equal(out, new), "a cancelled in-place write left a mix"

    _run(main())


def test_reopen_reads_objects_with_the_stripe_size_they_were_written_with(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 2)
    t = random_bytes(50_001, seed=6)

    async def main() -> None:
        async with StripeBackend(paths=dirs, stripe_bytes=4096) as b:
            await b.write("kept", t)
        async with open_backend({"type": "stripe", "paths": dirs, "stripe_bytes": "1MiB"}) as again:
            out = torch.empty_like(t)
            await again.read("kept", out)
            assert torch.equal(out, t)
            with pytest.raises(ValueError, match=r"'kept'.*50001.*50000"):
                await again.read("kept", torch.empty(50_000, dtype=torch.uint8))

    _run(main())


def test_corrupt_record_and_missing_stripe_are_storage_errors(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 2)
    t = random_bytes(9000, seed=7)

    async def main() -> None:
        async with StripeBackend(paths=dirs, stripe_bytes=4000) as b:
            await b.write("bad", t)
            rec = b._records["bad"]
            home = home_member("bad", 2)
        rec_file = Path(dirs[home]) / record_key("bad")
        raw = bytearray(rec_file.read_bytes())
        raw[20] ^= 0x10
        rec_file.write_bytes(bytes(raw))
        async with StripeBackend(paths=dirs, stripe_bytes=4000) as b:
            with pytest.raises(StorageIOError, match=r"key 'bad'.*record is corrupt"):
                await b.read("bad", torch.empty_like(t))
        raw[20] ^= 0x10
        rec_file.write_bytes(bytes(raw))
        (Path(dirs[(home + 1) % 2]) / stripe_key("bad", rec.generation, 1)).unlink()
        async with StripeBackend(paths=dirs, stripe_bytes=4000) as b:
            with pytest.raises(StorageIOError, match=r"read of key 'bad' stripe 1 .*inconsistent"):
                await b.read("bad", torch.empty_like(t))

    _run(main())


def test_another_member_count_is_refused_by_name(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 3)
    same = next(f"k{i}" for i in range(100) if home_member(f"k{i}", 2) == home_member(f"k{i}", 3))
    moved = next(f"k{i}" for i in range(100) if home_member(f"k{i}", 2) != home_member(f"k{i}", 3))

    async def main() -> None:
        async with StripeBackend(paths=dirs[:2]) as b:
            for key in (same, moved):
                await b.write(key, torch.ones(10))
        async with StripeBackend(paths=dirs) as b:
            with pytest.raises(
                StorageIOError, match=rf"key '{same}'.*striped over 2 members but this backend has 3"
            ):
                await b.read(same, torch.empty(10))
            with pytest.raises(StorageKeyError, match=rf"key '{moved}' not found in stripe backend"):
                await b.read(moved, torch.empty(10))

    _run(main())


# ---- description --------------------------------------------------------------------------
def test_capacity_is_the_raid0_bound() -> None:
    async def main() -> None:
        async with StripeBackend(
            members=[{"type": "cpu", "max_bytes": "1MiB"}, {"type": "cpu", "max_bytes": "3MiB"}]
        ) as b:
            cap = b.capacity()
            assert cap.total_bytes == 2 << 20  # min(1, 3) MiB x 2
            assert cap.free_bytes is not None and cap.free_bytes <= cap.total_bytes

    _run(main())


def test_capabilities_come_from_the_members(tmp_path: Path) -> None:
    d = _dirs(tmp_path, 2)

    async def main() -> None:
        async with StripeBackend(paths=d) as both_files:
            caps = both_files.capabilities
            assert caps.persistent and not caps.memory_like and caps.alignment_bytes == 4096
        async with StripeBackend(members=[{"type": "nvme", "path": d[0]}, {"type": "cpu"}]) as mixed:
            assert not mixed.capabilities.persistent  # one member forgets: the set forgets
        async with StripeBackend(members=[{"type": "cpu"}, {"type": "cpu", "max_bytes": "1GiB"}]) as mem:
            assert not mem.capabilities.memory_like  # no one resident tensor holds a striped object

    _run(main())


def test_spec_round_trips_members_and_paths(tmp_path: Path) -> None:
    d = _dirs(tmp_path, 2)

    async def main() -> None:
        for spec in (
            {"type": "stripe", "stripe_bytes": 65536, "paths": d, "member_options": {"fsync": False}},
            {"type": "stripe", "stripe_bytes": 65536, "paths": d, "atomic": False},
            {
                "type": "stripe",
                "stripe_bytes": 4096,
                "members": [{"type": "nvme", "path": d[0]}, {"type": "cpu"}],
            },
        ):
            async with open_backend(spec) as b:
                assert b.spec() == spec
        async with open_backend({"type": "stripe", "stripe_bytes": "4MiB", "paths": d}) as b:
            assert b.spec()["stripe_bytes"] == 4 << 20

    _run(main())


# ---- bad specs ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({}, "exactly one of 'members'"),
        ({"paths": ["/a"], "members": [{"type": "cpu"}]}, "not both"),
        ({"paths": []}, "paths must be a non-empty list"),
        ({"members": "cpu"}, "members must be a non-empty list"),
        ({"paths": [""]}, r"paths\[0\] must be a directory"),
        ({"members": [{"type": "cpu"}, {"type": "cpu"}]}, r"members\[0\] and members\[1\] are the same spec"),
        (
            {"members": [{"type": "cpu"}], "member_options": {"fsync": False}},
            "member_options applies to 'paths'",
        ),
        ({"paths": ["/a"], "member_options": {"path": "/b"}}, "without 'type' or 'path'"),
        ({"paths": ["/a"], "stripe_bytes": "lots"}, "stripe_bytes"),
        ({"paths": ["/a"], "stripe_bytes": 0}, "at least 1 byte"),
        ({"paths": ["/a"], "atomic": "no"}, "atomic must be true, false or left out"),
        ({"paths": ["/a"], "stripe_byte": 4096}, "unknown option 'stripe_byte'. Did you mean 'stripe_bytes'"),
        ({"members": [{"type": "cpu"}, 7]}, r"members\[1\]: expected a backend spec"),
    ],
)
def test_bad_specs_are_config_errors_naming_the_key(spec, match) -> None:
    with pytest.raises(ConfigError, match=match):
        open_backend({"type": "stripe", **spec})


def test_same_directory_twice_is_refused(tmp_path: Path) -> None:
    d = _dirs(tmp_path, 1)[0]
    with pytest.raises(ConfigError, match=r"paths\[0\] and paths\[1\] are the same directory"):
        StripeBackend(paths=[d, d + "/."])


def test_a_bad_member_names_its_index_and_closes_the_ones_opened(tmp_path: Path) -> None:
    root = Path(_dirs(tmp_path, 1)[0])
    with pytest.raises(BackendNotFoundError, match=r"members\[1\]: unknown storage backend 'nvmee'.*'nvme'"):
        StripeBackend(
            members=[{"type": "nvme", "path": str(root), "swap": True}, {"type": "nvmee", "path": "/x"}]
        )
    assert list(root.iterdir()) == [], "member 0's swap directory outlived the failed stripe set-up"
    with pytest.raises(
        ConfigError, match=r"paths\[0\]: backend .nvme.: unknown option .fsinc.. Did you mean .fsync."
    ):
        StripeBackend(paths=[str(root), str(tmp_path)], member_options={"fsinc": False})


def test_use_after_close_is_a_storage_error(tmp_path: Path) -> None:
    async def main() -> None:
        b = StripeBackend(paths=_dirs(tmp_path, 2))
        await b.close()
        with pytest.raises(StorageIOError, match="closed"):
            await b.write("x", torch.ones(1))

    _run(main())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_stripe_through_file_members(tmp_path: Path) -> None:
    async def main() -> None:
        async with StripeBackend(paths=_dirs(tmp_path, 2), stripe_bytes=(1 << 20) + 3) as b:
            src = random_bytes((5 << 20) + 11, seed=8).cuda()
            await b.write("dev", src)
            out = torch.empty_like(src)
            await b.read("dev", out)
            assert torch.equal(out, src)

    _run(main())
