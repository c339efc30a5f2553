"""`tiered bench` and `tiered demo`: the bookkeeping of the bandwidth runner (not speed)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

import tiered.bench.runner as br
from tiered.bench.methods import Method, aligned_buffer, read_chunk, write_chunk
from tiered.bench.runner import BenchOptions, run_bandwidth
from tiered.cli.main import main
from tiered.errors import StorageIOError

MIB = 1 << 20


class Recorder(Method):
    """A fake method: copies through a file, logs calls, can fail or corrupt on request."""

    def __init__(
        self,
        name: str,
        log: list[str],
        *,
        fail_round: int | None = None,
        corrupt: bool = False,
        kind: str = "backend",
        seconds: float = 0.0,
    ) -> None:
        super().__init__()
        self.name, self.kind, self.log = name, kind, log
        self.fail_round, self.corrupt, self.seconds = fail_round, corrupt, seconds
        self.calls = 0

    def write(self, src: torch.Tensor, mv: memoryview) -> float:
        self.calls += 1
        if self.fail_round is not None and self.calls == self.fail_round:
            raise OSError(f"{self.name} disk on fire")
        self.log.append(self.name)
        assert self.workdir is not None
        (self.workdir / "data.bin").write_bytes(bytes(mv))
        return self.seconds or 1e-3

    def read(self, dst: torch.Tensor, mv: memoryview) -> float:
        assert self.workdir is not None
        data = bytearray((self.workdir / "data.bin").read_bytes())
        if self.corrupt:
            data[7] ^= 0xFF
        mv[:] = data
        return self.seconds or 1e-3


def _fake(monkeypatch: pytest.MonkeyPatch, methods: list[Method]) -> None:
    monkeypatch.setattr(br, "build_methods", lambda opts: (methods, []))


def test_round_robin_rotates_and_drops_warmup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    methods = [Recorder(n, log, kind="ceiling" if n == "A" else "backend") for n in "ABC"]
    _fake(monkeypatch, methods)
    res = run_bandwidth(BenchOptions(tmp_path, size_bytes=64 * 1024, rounds=3, warmup_rounds=1))
    # 4 rounds, each runs every method once, order rotated by one per round.
    assert log == list("ABCBCACABABC")
    assert [m.status for m in res.methods] == ["ok", "ok", "ok"]
    assert all(len(m.write_s) == 3 and len(m.read_s) == 3 for m in res.methods)
    assert res.rounds == 3 and res.warmup_rounds == 1
    assert list(tmp_path.iterdir()) == []  # the work folder is removed


def test_failing_and_corrupting_methods_are_errors_others_continue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    methods = [
        Recorder("ceil", log, kind="ceiling"),
        Recorder("flaky", log, fail_round=2),
        Recorder("liar", log, corrupt=True),
    ]
    _fake(monkeypatch, methods)
    res = run_bandwidth(BenchOptions(tmp_path, size_bytes=8192, rounds=3, warmup_rounds=0))
    by = {m.name: m for m in res.methods}
    assert by["ceil"].status == "ok" and len(by["ceil"].write_s) == 3
    assert by["flaky"].status == "error" and "disk on fire" in by["flaky"].detail
    assert by["flaky"].write_gbps is None
    assert (
        by["liar"].status == "error" and "wrong bytes" in by["liar"].detail and "byte 7" in by["liar"].detail
    )
    assert log.count("ceil") == 3 and log.count("flaky") == 1 and log.count("liar") == 1
    md = res.to_markdown()
    assert "| flaky | backend | - | - | - | - | error: OSError: flaky disk on fire |" in md


def test_real_methods_bookkeeping(tmp_path: Path) -> None:
    opts = BenchOptions(
        tmp_path,
        size_bytes=MIB + 1,
        rounds=2,
        warmup_rounds=0,
        backends=("nvme", "aiofiles"),
        fio=False,
        deepspeed=False,
    )
    assert opts.aligned_size == MIB + 4096  # O_DIRECT moves whole 4 KiB blocks
    res = run_bandwidth(opts)
    assert res.size_bytes == MIB + 4096
    names = [m.name for m in res.methods]
    assert names[0].startswith("O_DIRECT pwritev/preadv 8 threads x 8 MiB")
    assert "tiered backend: nvme" in names and "tiered backend: aiofiles" in names
    assert {m.name: m.detail for m in res.methods if m.status == "absent"} == {
        "fio": "not requested",
        "DeepSpeed aio_handle": "not requested (--quick or --no-deepspeed)",
    }
    ceiling = res.methods[0]
    for m in res.methods:
        if m.status == "absent":
            continue
        assert m.status == "ok", m.detail
        assert len(m.write_s) == len(m.read_s) == 2 and all(t > 0 for t in m.write_s + m.read_s)
        assert m.write_gbps == pytest.approx(res.size_bytes / statistics.median(m.write_s) / 1e9, rel=1e-3)
        assert m.read_gbps == pytest.approx(res.size_bytes / statistics.median(m.read_s) / 1e9, rel=1e-3)
        assert m.write_vs_ceiling == pytest.approx(m.write_gbps / ceiling.write_gbps)
        assert m.read_vs_ceiling == pytest.approx(m.read_gbps / ceiling.read_gbps)
    assert ceiling.write_vs_ceiling == 1.0
    assert list(tmp_path.iterdir()) == []


def test_chunk_write_and_read_round_trip_and_a_short_file_is_an_error(tmp_path: Path) -> None:
    # the ceiling's one-chunk primitives, which benchmarks/nvme_pattern.py drives on its own files
    n = 3 * 4096
    src_mm, src = aligned_buffer(n)
    dst_mm, dst = aligned_buffer(n)
    src.copy_((torch.arange(n) % 251).to(torch.uint8))
    path = tmp_path / "chunks.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for off in (4096, 0, 8192):  # any order, as the thread pool runs them
            write_chunk(fd, memoryview(src_mm), off, 4096)
        for off in (8192, 0, 4096):
            read_chunk(fd, memoryview(dst_mm), off, 4096)
        assert torch.equal(dst, src)
        # at a base: the buffer is one region of a larger file (nvme_pattern's one-file reference)
        for off in (0, 4096, 8192):
            write_chunk(fd, memoryview(src_mm), off, 4096, base=n)
        assert os.fstat(fd).st_size == 2 * n
        dst.zero_()
        for off in (8192, 4096, 0):
            read_chunk(fd, memoryview(dst_mm), off, 4096, base=n)
        assert torch.equal(dst, src)
        assert torch.equal(torch.frombuffer(bytearray(os.pread(fd, n, n)), dtype=torch.uint8), src)
        os.ftruncate(fd, n - 100)
        with pytest.raises(StorageIOError, match="file ended early"):
            read_chunk(fd, memoryview(dst_mm), 8192, 4096)
    finally:
        os.close(fd)


def test_bad_backend_is_an_error_row_not_a_crash(tmp_path: Path) -> None:
    res = run_bandwidth(
        BenchOptions(
            tmp_path,
            size_bytes=8192,
            rounds=1,
            warmup_rounds=0,
            backends=("no_such_backend",),
            fio=False,
            deepspeed=False,
        )
    )
    row = res.methods[1]
    assert row.status == "error" and "no_such_backend" in row.detail
    assert res.methods[0].status == "ok"


def test_fio_absent_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiered.bench.methods as bw

    monkeypatch.setattr(bw.shutil, "which", lambda name: None)
    methods, absent = br.build_methods(BenchOptions(tmp_path, size_bytes=8192, backends=(), deepspeed=False))
    assert [m.kind for m in methods] == ["ceiling"]
    assert absent[0].name == "fio" and absent[0].detail.startswith("absent (no `fio` on PATH)")


def test_cli_bench_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    work = tmp_path / "work"
    work.mkdir()
    code = main(
        [
            "bench",
            "--dir",
            str(work),
            "--size",
            "256KiB",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--backends",
            "nvme",
            "--no-fio",
            "--no-deepspeed",
            "--quiet",
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "| method | kind | write GB/s | read GB/s | write / O_DIRECT | read / O_DIRECT | status |" in out
    doc = json.loads(out_json.read_text())
    assert doc["size_bytes"] == 256 * 1024 and doc["rounds"] == 1
    assert [m["status"] for m in doc["methods"][:2]] == ["ok", "ok"]
    assert {"platform", "cpu_count", "torch"} <= set(doc["machine"])
    assert doc["compute"]["flops_per_s"] > 0  # the FLOP rate tiered plan --bandwidth reads
    # [Note: host rates measured]: the CPU Adam's and the host copy's rates, read by the plan
    assert doc["cpu_adam"]["elements_per_s"] > 0 and doc["host_copy"]["gbps"] > 0
    from tiered.planning.timing import read_bandwidth

    bw, said = read_bandwidth(out_json)
    assert bw["cpu_adam"] == doc["cpu_adam"]["elements_per_s"]
    assert bw["host_copy"] == doc["host_copy"]["gbps"] * 1e9
    assert any(s.startswith("CPU Adam") and "assumed" not in s for s in said)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--size", "huge"], "--size: cannot read 'huge'"),
        (["--size", "100"], "below the 4096 B minimum"),
        (["--dir", "no/such/dir"], "--dir no/such/dir: not an existing directory"),
    ],
)
def test_cli_bench_bad_input(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--quiet", "--no-fio", "--no-deepspeed", *argv]
    if "--dir" not in argv:
        args += ["--dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tiered bench: error:") and needle in err and len(err.splitlines()) == 1


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_demo_plan_only_prints_the_40b_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "== tiered plan --params 40B" in out
    # the search's fastest config that fits 80 GB GPU / 512 GB host: the optimizer must leave the
    # GPU (DP..ZeRO-3 without offload need 640 GB of it for model states alone), and 512 GB cannot
    # hold its 480 GB of state beside the rest, so it goes to NVMe
    assert "recommended: optimizer nvme" in out and "s/step" in out
    assert "ZeRO-3                                     640.0" in out and "no (GPU +560.0)" in out
    assert "  none      none    gpu" in out  # the search's own row for no offload: it does not fit


def test_demo_runs_finetune_then_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fine-tuning part itself is tested in test_finetune.py; here: demo.py's dispatch and the bench.
    import tiered.cli.demo_finetune as demo_finetune

    calls: list[tuple[bool, Path | None]] = []

    def fake_run_demo(quick: bool, workdir: Path | None, out=None) -> int:
        calls.append((quick, workdir))
        return 0

    monkeypatch.setattr(demo_finetune, "run_demo", fake_run_demo)
    assert main(["demo", "--quick", "--bench", "--dir", str(tmp_path), "--bench-size", "256KiB"]) == 0
    assert calls == [(True, tmp_path)]
    out = capsys.readouterr().out
    assert "== 3. tiered bench --quick" in out
    assert "| tiered backend: nvme | backend |" in out
    assert list(tmp_path.iterdir()) == []


def test_results_section_replaces_only_bandwidth(tmp_path: Path) -> None:
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bandwidth.py"
    spec = importlib.util.spec_from_file_location("bandwidth_script", script)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    f = tmp_path / "RESULTS.md"
    f.write_text("# Benchmark results\n\n## CPU Adam\n\nadam table\n")
    mod.write_section(f, "## Bandwidth\n\nfirst\n")
    assert f.read_text() == "# Benchmark results\n\n## CPU Adam\n\nadam table\n\n## Bandwidth\n\nfirst\n"
    f.write_text(f.read_text() + "\n## Later\n\nkeep me\n")
    mod.write_section(f, "## Bandwidth\n\nsecond\n")
    text = f.read_text()
    assert "first" not in text and "second" in text
    assert "adam table" in text and "## Later\n\nkeep me" in text
