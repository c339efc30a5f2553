"""The tensorstore backend: conformance on the memory and file kvstores, spec errors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiered_tensorstore import TensorStoreBackend

from tiered.errors import ConfigError
from tiered.storage import open_backend
from tiered.testing import BackendConformance


class TestTensorStoreMemoryConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return TensorStoreBackend()


class TestTensorStoreFileConformance(BackendConformance):
    def make_backend(self, tmp_path):
        return TensorStoreBackend({"driver": "file", "path": str(tmp_path) + "/"})


def test_file_kvstore_stores_raw_bytes(tmp_path) -> None:
    async def main() -> None:
        b = open_backend({"type": "tensorstore", "kvstore": {"driver": "file", "path": str(tmp_path) + "/"}})
        t = torch.arange(100, dtype=torch.int32)
        await b.write("raw", t)
        assert (tmp_path / "raw").read_bytes() == t.numpy().tobytes()
        assert b.capabilities.persistent
        await b.close()

    asyncio.run(main())


def test_bad_kvstore_spec_is_config_error() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        TensorStoreBackend({"driver": "bogus"})


def test_failure_mid_operation_is_storage_io_error_with_context() -> None:
    from tiered.errors import StorageIOError

    class FailingKv:
        def __init__(self, real):
            self.real = real

        def read(self, key, **kw):
            return self.real.read(key, **kw)

        def write(self, key, value):
            raise ValueError("injected: quota exceeded")

    async def main() -> None:
        b = TensorStoreBackend()
        b._kv = FailingKv(b._kv)
        with pytest.raises(StorageIOError, match=r"kvstore \{'driver': 'memory'\} key 'w'.*quota exceeded"):
            await b.write("w", torch.ones(4))
        assert not await b.exists("w")

    asyncio.run(main())
