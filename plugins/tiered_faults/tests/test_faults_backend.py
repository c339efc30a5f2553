"""The faults backend: conformance when it injects nothing, then each fault kind with its exact
error, behaviour and counters, the triggers, and spec errors."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path

import pytest
import torch
from tiered_faults import FaultsBackend

from tiered.errors import BackendNotFoundError, ConfigError, StorageIOError
from tiered.storage import open_backend
from tiered.testing import BackendConformance, random_bytes


class TestFaultsNoFaultsConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return FaultsBackend({"type": "nvme", "path": str(tmp_path)})


class TestFaultsOverMemoryConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return FaultsBackend({"type": "cpu"}, faults=[])


class TestFaultsDelayOverStripeConformance(BackendConformance):
    """A fault that changes only timing keeps every promise; and faults over stripe over nvme."""

    def make_backend(self, tmp_path):
        dirs = [tmp_path / "a", tmp_path / "b"]
        for d in dirs:
            d.mkdir(exist_ok=True)
        inner = {
            "type": "stripe",
            "stripe_bytes": 300_001,
            "paths": [str(d) for d in dirs],
            "member_options": {"fsync": False},
        }
        return FaultsBackend(inner, faults=[{"kind": "delay", "delay_s": 0.001, "every": 3}])


def _run(coro):
    return asyncio.run(coro)


def _faults(*rules, inner=None, seed=0) -> FaultsBackend:
    return open_backend(
        {"type": "faults", "inner": inner or {"type": "cpu"}, "faults": list(rules), "seed": seed}
    )


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> list[tuple[int, int]]:
    x = (a.view(torch.uint8) ^ b.view(torch.uint8)).tolist()
    return [(i, bit) for i, v in enumerate(x) for bit in range(8) if v >> bit & 1]


# ---- error ----------------------------------------------------------------------------------
def test_the_nth_read_fails_with_the_chosen_errno_and_nothing_else_does() -> None:
    async def main() -> None:
        async with _faults({"kind": "error", "op": "read", "nth": 3, "errno": "EAGAIN"}) as b:
            t = torch.arange(8.0)
            await b.write("w", t)
            out = torch.empty(8)
            for i in range(1, 6):
                if i == 3:
                    with pytest.raises(
                        StorageIOError, match=r"injected EAGAIN .* on read #3 of key 'w' by faults\[0\]"
                    ) as info:
                        await b.read("w", out)
                    assert info.value.errno == errno.EAGAIN and isinstance(info.value, OSError)
                    assert "'cpu'" in str(info.value)  # names the wrapped backend
                else:
                    await b.read("w", out)
                    assert torch.equal(out, t)
            s = b.stats()
            assert s["injected"]["error"] == 1 and s["injected_total"] == 1
            assert s["rules"] == [{"index": 0, "kind": "error", "matched": 5, "fired": 1, "injected": 1}]
            assert s["ops"] == {"read": 5, "write": 1, "delete": 0, "exists": 0}
            assert list(b.history) == [
                {"rule": 0, "kind": "error", "op": "read", "key": "w", "detail": "raised EAGAIN"}
            ]

    _run(main())


def test_a_failed_write_leaves_the_old_copy(tmp_path: Path) -> None:
    async def main() -> None:
        async with _faults(
            {"kind": "error", "op": "write", "nth": 2}, inner={"type": "nvme", "path": str(tmp_path)}
        ) as b:
            old = random_bytes(5000, seed=1)
            await b.write("k", old)
            with pytest.raises(StorageIOError, match="injected EIO") as info:
                await b.write("k", random_bytes(5000, seed=2))
            assert info.value.errno == errno.EIO
            out = torch.empty_like(old)
            await b.read("k", out)
            assert torch.equal(out, old)

    _run(main())


def test_key_globs_ops_every_after_and_max_fires() -> None:
    async def main() -> None:
        rule = {
            "kind": "error",
            "op": ["delete", "exists"],
            "key": "*.exp_avg",
            "every": 2,
            "after": 1,
            "max_fires": 2,
        }
        async with _faults(rule) as b:
            await b.write("g0.exp_avg", torch.ones(2))
            await b.write("g0.param", torch.ones(2))
            outcomes = []
            for _ in range(8):
                try:
                    await b.exists("g0.exp_avg")
                    outcomes.append("ok")
                except StorageIOError:
                    outcomes.append("EIO")
                assert await b.exists("g0.param")  # another key: never
            # match 1 is skipped (after), then every 2nd of the rest fires, twice at most
            assert outcomes == ["ok", "ok", "EIO", "ok", "EIO", "ok", "ok", "ok"]
            assert b.stats()["rules"][0] == {
                "index": 0,
                "kind": "error",
                "matched": 8,
                "fired": 2,
                "injected": 2,
            }

    _run(main())


def test_probability_is_seeded_per_rule() -> None:
    async def pattern(seed: int, *, with_other_rule: bool) -> list[bool]:
        rules = [{"kind": "error", "op": "read", "probability": 0.3}]
        if with_other_rule:  # another rule's draws must not shift this one's
            rules.insert(0, {"kind": "delay", "op": "read", "delay_s": 1e-6, "probability": 0.5})
        async with _faults(*rules, seed=seed) as b:
            await b.write("k", torch.ones(1))
            got = []
            for _ in range(200):
                try:
                    await b.read("k", torch.empty(1))
                    got.append(False)
                except StorageIOError:
                    got.append(True)
            assert b.stats()["injected"]["error"] == sum(got)
            return got

    a, again = _run(pattern(7, with_other_rule=False)), _run(pattern(7, with_other_rule=False))
    assert a == again and 30 <= sum(a) <= 90
    assert _run(pattern(8, with_other_rule=False)) != a
    shifted = _run(pattern(7, with_other_rule=True))
    assert shifted != a  # rule 1 now: its own generator (seeded by index), not rule 0's


# ---- delay and hang -------------------------------------------------------------------------
def test_delay_delays_only_the_chosen_operations() -> None:
    async def main() -> None:
        async with _faults({"kind": "delay", "op": "write", "delay_s": 0.25}) as b:
            t0 = time.perf_counter()
            await b.write("k", torch.ones(4))
            slow = time.perf_counter() - t0
            t0 = time.perf_counter()
            await b.read("k", torch.empty(4))
            fast = time.perf_counter() - t0
            assert slow >= 0.25 and fast < 0.2
            assert b.stats()["injected"]["delay"] == 1

    _run(main())


def test_hang_lasts_until_cancelled_or_closed() -> None:
    async def main() -> None:
        b = _faults({"kind": "hang", "op": "read", "nth": [1, 2]})
        await b.write("k", torch.ones(4))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.read("k", torch.empty(4)), timeout=0.2)
        hung = asyncio.ensure_future(b.read("k", torch.empty(4)))
        await asyncio.sleep(0.05)
        assert not hung.done()
        await b.close()
        with pytest.raises(StorageIOError, match=r"read of key 'k' hung by faults\[0\].*was closed"):
            await asyncio.wait_for(hung, timeout=5)
        assert b.stats()["injected"]["hang"] == 2

    _run(main())


def test_a_hung_close_lasts_until_cancelled_and_still_closes_the_inner_backend() -> None:
    async def main() -> None:
        b = _faults({"kind": "hang", "op": "close"})
        await b.write("k", torch.ones(4))
        await b.read("k", torch.empty(4))  # data operations are not touched
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.close(), timeout=0.2)
        assert b.stats()["injected"]["hang"] == 1
        with pytest.raises(StorageIOError, match="closed"):
            await b.inner.read("k", torch.empty(4))
        await b.close()  # idempotent: no second hang

    _run(main())


def test_any_means_the_data_operations_not_close() -> None:
    assert "close" not in _faults({"kind": "hang", "op": "any"}).rules[0].ops
    with pytest.raises(ConfigError, match="'close' is not an operation a 'error' fault applies to"):
        _faults({"kind": "error", "op": "close"})


# ---- enospc ---------------------------------------------------------------------------------
def test_enospc_after_k_bytes_written() -> None:
    async def main() -> None:
        async with _faults({"kind": "enospc", "after_bytes": 10_000}) as b:
            await b.write("a", torch.zeros(4000, dtype=torch.uint8))
            await b.write("a", torch.zeros(4000, dtype=torch.uint8))  # written counts overwrites too
            with pytest.raises(
                StorageIOError,
                match=r"injected ENOSPC .*write #3 of key 'b'.*8000 of its 10000 bytes written",
            ) as info:
                await b.write("b", torch.zeros(4000, dtype=torch.uint8))
            assert info.value.errno == errno.ENOSPC
            assert not await b.exists("b")
            await b.write("c", torch.zeros(2000, dtype=torch.uint8))  # what still fits, fits
            assert b.stats()["injected"]["enospc"] == 1

    _run(main())


def test_enospc_on_stored_bytes_frees_space_on_delete() -> None:
    async def main() -> None:
        async with _faults({"kind": "enospc", "after_bytes": "10KB", "count": "stored"}) as b:
            assert b.capacity().total_bytes == 10_000 and b.capacity().free_bytes == 10_000
            await b.write("a", torch.zeros(6000, dtype=torch.uint8))
            await b.write("a", torch.zeros(6000, dtype=torch.uint8))  # an overwrite needs no more room
            assert b.capacity().free_bytes == 4000
            with pytest.raises(StorageIOError, match="ENOSPC") as info:
                await b.write("b", torch.zeros(6000, dtype=torch.uint8))
            assert info.value.errno == errno.ENOSPC
            await b.delete("a")
            await b.write("b", torch.zeros(6000, dtype=torch.uint8))  # the retry after freeing space works

    _run(main())


# ---- torn writes ----------------------------------------------------------------------------
def test_torn_write_stores_a_sector_aligned_prefix_then_fails(tmp_path: Path) -> None:
    async def main() -> None:
        inner = {"type": "nvme", "path": str(tmp_path)}
        async with _faults({"kind": "torn_write", "nth": 2}, inner=inner) as b:
            await b.write("k", random_bytes(10_000, seed=1))
            new = random_bytes(10_000, seed=2)
            with pytest.raises(
                StorageIOError, match=r"injected EIO .*torn write, 4608 of 10000 bytes"
            ) as info:
                await b.write("k", new)
            assert info.value.errno == errno.EIO
            assert (tmp_path / "k").stat().st_size == 4608  # 5000 rounded down to 512-byte sectors
            with pytest.raises(ValueError, match="4608"):  # what the nvme backend says of a short file
                await b.read("k", torch.empty(10_000, dtype=torch.uint8))
            prefix = torch.empty(4608, dtype=torch.uint8)
            await b.read("k", prefix)
            assert torch.equal(prefix, new[:4608])
            assert b.stats()["injected"]["torn_write"] == 1

    _run(main())


def test_silent_torn_write_returns_and_leaves_a_truncated_object(tmp_path: Path) -> None:
    async def main() -> None:
        rule = {"kind": "torn_write", "mode": "silent", "keep_bytes": 3000, "sector_bytes": 1000}
        async with _faults(rule, inner={"type": "nvme", "path": str(tmp_path)}) as b:
            await b.write("k", random_bytes(8192, seed=3))  # no error
            assert (tmp_path / "k").stat().st_size == 3000
            assert [h["detail"] for h in b.history] == ["stored 3000 of 8192 bytes (silent)"]

    _run(main())


# ---- bit flips ------------------------------------------------------------------------------
def test_bitflip_on_write_corrupts_the_stored_copy_for_good(tmp_path: Path) -> None:
    async def main() -> None:
        rule = {"kind": "bitflip", "op": "write", "offset": 100, "bit": 6}
        async with _faults(rule, inner={"type": "nvme", "path": str(tmp_path)}) as b:
            t = random_bytes(4096, seed=4)
            before = t.clone()
            await b.write("k", t)
            assert torch.equal(t, before), "the caller's tensor must not change"
            assert _bits_differ(
                torch.frombuffer(bytearray((tmp_path / "k").read_bytes()), dtype=torch.uint8), t
            ) == [(100, 6)]
            for _ in range(2):
                out = torch.empty_like(t)
                await b.read("k", out)
                assert _bits_differ(out, t) == [(100, 6)]
            assert b.stats()["injected"]["bitflip"] == 1

    _run(main())


def test_bitflip_on_read_corrupts_only_that_read() -> None:
    async def main() -> None:
        async with _faults({"kind": "bitflip", "op": "read", "nth": 1, "bits": 3}, seed=5) as b:
            t = torch.randn(1000)
            await b.write("k", t)
            out = torch.empty_like(t)
            await b.read("k", out)
            flipped = _bits_differ(out, t)
            assert len(flipped) == 3
            await b.read("k", out)
            assert torch.equal(out, t)  # the stored copy is intact
            assert b.history[0]["detail"].endswith(", ".join(f"{i}:{bit}" for i, bit in flipped))

    _run(main())


def test_bitflip_past_the_end_fires_but_injects_nothing() -> None:
    async def main() -> None:
        async with _faults({"kind": "bitflip", "op": "read", "offset": 10}) as b:
            await b.write("k", torch.ones(2, dtype=torch.uint8))
            await b.read("k", torch.empty(2, dtype=torch.uint8))
            assert b.stats()["rules"][0] == {
                "index": 0,
                "kind": "bitflip",
                "matched": 1,
                "fired": 1,
                "injected": 0,
            }

    _run(main())


# ---- composition and description ------------------------------------------------------------
def test_faults_over_stripe_over_nvme(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    spec = {
        "type": "faults",
        "inner": {"type": "stripe", "stripe_bytes": 1000, "paths": [str(d) for d in dirs]},
        "faults": [{"kind": "error", "op": "read", "nth": 1, "errno": "EIO"}],
        "seed": 0,
    }

    async def main() -> None:
        async with open_backend(spec) as b:
            assert b.spec() == spec and b.capabilities.persistent
            await b.write("k", random_bytes(3000, seed=1))
            with pytest.raises(StorageIOError, match="faults backend over 'stripe'"):
                await b.read("k", torch.empty(3000, dtype=torch.uint8))
            inner = b.inner
        assert inner._closed and all(m._closed for m in inner.members)  # close() closed them all

    _run(main())


def test_never_memory_like_so_no_resident_tensor_bypasses_the_faults() -> None:
    async def main() -> None:
        async with _faults() as b:
            assert b.inner.capabilities.memory_like and not b.capabilities.memory_like
            with pytest.raises(NotImplementedError):
                b.allocate("x", 4, torch.float32)

    _run(main())


def test_spec_round_trips_every_kind(tmp_path: Path) -> None:
    rules = [
        {"kind": "error", "op": "any", "nth": [2, 5], "errno": "ENOSPC"},
        {"kind": "delay", "delay_s": 0.5, "probability": 0.1, "key": "g*"},
        {"kind": "hang", "op": "exists", "after": 3, "max_fires": 1},
        {"kind": "enospc", "after_bytes": 1 << 30, "count": "stored"},
        {"kind": "torn_write", "mode": "silent", "keep_fraction": 0.25, "sector_bytes": 4096},
        {"kind": "bitflip", "op": "write", "bits": 2, "every": 10},
    ]

    async def main() -> None:
        async with _faults(*rules, seed=3) as b:
            spec = b.spec()
            assert spec["faults"][0] == {
                "kind": "error",
                "op": ["read", "write", "delete", "exists"],
                "nth": [2, 5],
                "errno": "ENOSPC",
            }
            assert spec["faults"][1:] == rules[1:]
            async with open_backend(spec) as again:
                assert again.spec() == spec

    _run(main())


def test_use_after_close_is_a_storage_error() -> None:
    async def main() -> None:
        b = _faults()
        await b.close()
        with pytest.raises(StorageIOError, match="closed"):
            await b.read("k", torch.empty(1))

    _run(main())


# ---- bad specs ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rule", "match"),
    [
        (
            {"kind": "bitfip", "op": "read"},
            r"faults\[0\]: unknown fault kind 'bitfip'. Did you mean 'bitflip'",
        ),
        ({"op": "read"}, r"faults\[0\]: missing 'kind'"),
        (
            {"kind": "error", "op": "read", "nht": 2},
            r"unknown option 'nht' for a 'error' fault. Did you mean 'nth'",
        ),
        ({"kind": "error", "nth": 2}, r"a 'error' fault needs 'op'"),
        ({"kind": "error", "op": "red"}, r"faults\[0\].op: 'red' is not an operation .* Did you mean 'read'"),
        ({"kind": "bitflip", "op": "delete"}, r"'delete' is not an operation a 'bitflip' fault applies to"),
        (
            {"kind": "error", "op": "read", "errno": "EIOO"},
            r"errno: 'EIOO' is not an errno name. Did you mean 'EIO'",
        ),
        ({"kind": "error", "op": "read", "errno": 99999}, r"errno: expected an errno name"),
        (
            {"kind": "error", "op": "read", "nth": 2, "probability": 0.5},
            r"at most one of nth, every, probability",
        ),
        ({"kind": "error", "op": "read", "probability": 1.5}, r"probability: expected a number in \[0, 1\]"),
        ({"kind": "error", "op": "read", "nth": 0}, r"nth: expected an integer >= 1"),
        ({"kind": "delay"}, r"a 'delay' fault needs 'delay_s'"),
        ({"kind": "delay", "delay_s": -1}, r"delay_s: expected seconds > 0"),
        ({"kind": "enospc"}, r"needs 'after_bytes'"),
        (
            {"kind": "enospc", "after_bytes": "1 GiB", "count": "live"},
            r"count: 'live' is not one of written, stored",
        ),
        ({"kind": "enospc", "after_bytes": "lots"}, r"faults\[0\].after_bytes"),
        ({"kind": "torn_write", "op": "write"}, r"unknown option 'op' for a 'torn_write' fault"),
        (
            {"kind": "torn_write", "mode": "slient"},
            r"mode: 'slient' is not one of error, silent. Did you mean 'silent'",
        ),
        (
            {"kind": "torn_write", "keep_fraction": 0.5, "keep_bytes": 10},
            r"keep_fraction or keep_bytes, not both",
        ),
        ({"kind": "torn_write", "mode": "silent", "errno": "EIO"}, r"a 'silent' torn write raises nothing"),
        ({"kind": "bitflip", "op": "read", "bit": 3}, r"give 'offset' too"),
        ({"kind": "bitflip", "op": "read", "offset": 0, "bit": 8}, r"bit: expected 0..7"),
        ("error", r"faults\[0\]: expected a dict"),
    ],
)
def test_bad_rules_are_config_errors_naming_the_rule_and_option(rule, match) -> None:
    with pytest.raises(ConfigError, match=match):
        _faults(rule)


def test_bad_top_level_options() -> None:
    with pytest.raises(ConfigError, match=r"backend 'faults': unknown option 'fault'. Did you mean 'faults'"):
        open_backend({"type": "faults", "inner": {"type": "cpu"}, "fault": []})
    with pytest.raises(ConfigError, match="missing required option.*'inner'"):
        open_backend({"type": "faults"})
    with pytest.raises(ConfigError, match="seed must be an integer"):
        open_backend({"type": "faults", "inner": "cpu", "seed": "x"})
    with pytest.raises(
        BackendNotFoundError, match=r"option 'inner': unknown storage backend 'nvmee'. Did you mean 'nvme'"
    ):
        open_backend({"type": "faults", "inner": {"type": "nvmee", "path": "/x"}})
    with pytest.raises(ConfigError, match=r"option 'inner': backend 'cpu': unknown option 'max_byte'"):
        open_backend({"type": "faults", "inner": {"type": "cpu", "max_byte": 1}})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bitflip_on_cuda_tensors(tmp_path: Path) -> None:
    async def main() -> None:
        rules = [
            {"kind": "bitflip", "op": "read", "offset": 7, "bit": 1},
            {"kind": "bitflip", "op": "write", "offset": 3, "bit": 0},
        ]
        async with _faults(*rules, inner={"type": "nvme", "path": str(tmp_path)}) as b:
            src = random_bytes(1 << 20, seed=9).cuda()
            await b.write("dev", src)
            out = torch.empty_like(src)
            await b.read("dev", out)
            assert sorted(_bits_differ(out.cpu(), src.cpu())) == [(3, 0), (7, 1)]

    _run(main())
