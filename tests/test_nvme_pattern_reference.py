"""benchmarks/nvme_pattern.py's references move the case's own memory (issue: bench, item 6).

On a VM where a buffer's physical pages lie changes O_DIRECT rates by up to 1.5x, a reference with
buffers of its own measures memory, not the backend ([Note: nvme training-pattern benchmark]). So
each case's raw reference moves the case's own mappings, as whole pages, end to end into one file;
and what it reads back never stays in the case's destinations, where it could pass the backend's
read check for it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tiered.bench.methods import ODirectMethod
from tiered.bench.preflight import direct_io_supported

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "nvme_pattern.py"


@pytest.fixture(scope="module")
def pattern():
    spec = importlib.util.spec_from_file_location("nvme_pattern_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "64 B past a page"])
def test_the_reference_moves_the_case_s_own_pages_into_one_file(
    pattern, tmp_path: Path, aligned: bool
) -> None:
    if not direct_io_supported(tmp_path)[0]:
        pytest.skip("the temp directory's filesystem refuses O_DIRECT")
    sizes = [3 * 4096, 5000, 4096 + 17]  # whole pages, a ragged one, one just past a page
    bufs = pattern.Buffers(sizes, aligned)
    assert all(t.data_ptr() % 4096 == (0 if aligned else pattern.UNALIGNED_BY) for t in bufs.src + bufs.dst)
    pool = ODirectMethod(threads=2, chunk_bytes=4096)
    try:
        ref = pattern.RawCase("ref", pool, [tmp_path / "one.bin"], bufs, own=True)
        assert ref.total == sum(sizes)
        ref.write()
        data = (tmp_path / "one.bin").read_bytes()
        at = 0
        for (src_pages, _), t, n in zip(bufs.pages(), bufs.src, sizes, strict=True):
            region = data[at : at + len(src_pages)]
            assert region == bytes(src_pages), "a region is not the case's own source pages"
            past = 0 if aligned else pattern.UNALIGNED_BY
            assert region[past : past + n] == t.numpy().tobytes()
            at += len(src_pages)
        assert (
            at == len(data) == sum(pattern._pad(n + (0 if aligned else pattern.UNALIGNED_BY)) for n in sizes)
        )
        for d in bufs.dst:
            d.fill_(0xAB)
        ref.read()
        assert all(not d.any() for d in bufs.dst), (
            "the reference's read bytes stayed in the case's destinations"
        )
        ref.close()
    finally:
        pool.close()


def test_the_one_buffer_reference_writes_random_bytes(pattern, tmp_path: Path) -> None:
    if not direct_io_supported(tmp_path)[0]:
        pytest.skip("the temp directory's filesystem refuses O_DIRECT")
    pool = ODirectMethod(threads=2, chunk_bytes=4096)
    try:
        ref = pattern.RawCase("own", pool, [tmp_path / "one.bin"], pattern.Buffers([8192], True), own=True)
        ref.write()
        data = torch.frombuffer(bytearray((tmp_path / "one.bin").read_bytes()), dtype=torch.uint8)
        assert data.numel() == 8192 and data.unique().numel() > 100, "not random bytes (the zero page?)"
        ref.close()
    finally:
        pool.close()
