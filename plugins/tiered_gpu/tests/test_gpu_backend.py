"""The gpu backend: conformance (on the CPU stand-in here; on CUDA where present)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiered_gpu import GPUBackend

from tiered.testing import BackendConformance, random_bytes


class TestGPUConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return GPUBackend()


def test_explicit_device_spec_round_trips() -> None:
    from tiered.storage import open_backend

    b = open_backend({"type": "gpu", "device": "cpu"})
    assert b.spec() == {"type": "gpu", "device": "cpu"} and b.device.kind == "cpu"
    assert open_backend(b.spec()).spec() == b.spec()


def test_resident_tensor_lives_on_the_compute_device() -> None:
    async def main() -> None:
        b = GPUBackend()
        await b.write("w", torch.arange(10.0))
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert b.view("w").device.type == expected
        assert b.capabilities.device.startswith(expected)
        await b.close()

    asyncio.run(main())


def test_large_overwrite_swaps_buffer_only_when_complete() -> None:
    """A large write copies into a fresh buffer; the old resident tensor is untouched until the swap."""

    async def main() -> None:
        b = GPUBackend(device="cpu")
        old = random_bytes(16 << 20, seed=1)
        await b.write("k", old)
        before = b.view("k")
        new = random_bytes(16 << 20, seed=2)
        await b.write("k", new)
        assert torch.equal(before, old), "the old buffer was overwritten in place"
        assert torch.equal(b.view("k"), new)
        await b.close()

    asyncio.run(main())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_round_trip_from_host_and_device() -> None:
    async def main() -> None:
        b = GPUBackend(device="cuda")
        host = random_bytes(3 << 20, seed=3)
        await b.write("h", host)
        dev_out = torch.empty_like(host, device="cuda")
        await b.read("h", dev_out)
        assert torch.equal(dev_out.cpu(), host)
        await b.close()

    asyncio.run(main())
