"""The backend registry and the plugin API: a third-party backend passes the conformance suite."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

import tiered
from tiered.errors import (
    BackendExistsError,
    BackendImportError,
    BackendNotFoundError,
    ConfigError,
    StorageKeyError,
)
from tiered.storage import (
    Capabilities,
    Capacity,
    StorageBackend,
    check_key,
    check_out_size,
    get_backend_class,
    known_backends,
    open_backend,
    register_backend,
    tensor_bytes,
    unregister_backend,
)
from tiered.testing import BackendConformance


@pytest.fixture(autouse=True)
def _forget_test_registrations():
    yield
    unregister_backend("dictmem")


class DictBackend(StorageBackend):
    """A third-party backend written against the public contract only: bytes in a dict."""

    name = "dictmem"

    def __init__(self, label: str = "default") -> None:
        self.label = label
        self._data: dict[str, bytes] = {}

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(persistent=False, memory_like=False)

    async def write(self, key: str, tensor: torch.Tensor) -> None:
        self._data[check_key(key)] = tensor_bytes(tensor, what=key).numpy().tobytes()

    async def read(self, key: str, out: torch.Tensor) -> None:
        if check_key(key) not in self._data:
            raise StorageKeyError(f"key {key!r} not found in dictmem")
        value = self._data[key]
        dst = tensor_bytes(out, what=key)
        check_out_size(key, len(value), dst.numel())
        if value:
            dst.copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))

    async def delete(self, key: str) -> None:
        if check_key(key) not in self._data:
            raise StorageKeyError(f"key {key!r} not found in dictmem")
        del self._data[key]

    async def exists(self, key: str) -> bool:
        return check_key(key) in self._data

    def capacity(self) -> Capacity:
        return Capacity(None, None)

    def spec(self) -> dict:
        return {"type": self.name, "label": self.label}


class TestThirdPartyBackendConformance(BackendConformance):
    """Five lines: the plugin API is sufficient for a backend tiered has never seen."""

    def make_backend(self, tmp_path):
        register_backend("dictmem", DictBackend)
        return tiered.open_backend({"type": "dictmem", "label": "conformance"})


class _ReversingBackend(DictBackend):
    async def read(self, key: str, out: torch.Tensor) -> None:
        await super().read(key, out)
        flat = tensor_bytes(out, what=key)
        flat.copy_(torch.flip(flat.clone(), [0]))


class _NoSizeCheckBackend(DictBackend):
    async def read(self, key: str, out: torch.Tensor) -> None:
        if check_key(key) not in self._data:
            raise StorageKeyError(key)
        dst = tensor_bytes(out, what=key)
        n = min(len(self._data[key]), dst.numel())
        dst[:n].copy_(torch.frombuffer(bytearray(self._data[key][:n]), dtype=torch.uint8))


def test_conformance_suite_catches_broken_backends(tmp_path) -> None:
    class Reversing(BackendConformance):
        check_spec_roundtrip = False

        def make_backend(self, tmp_path):
            return _ReversingBackend()

    class NoSizeCheck(Reversing):
        def make_backend(self, tmp_path):
            return _NoSizeCheckBackend()

    with pytest.raises(AssertionError, match="bytes differ"):
        Reversing().test_roundtrip_sizes(tmp_path, 4097)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        NoSizeCheck().test_read_into_wrong_size_is_value_error(tmp_path)


def test_builtins_come_from_entry_points_without_importing() -> None:
    code = (
        "import sys, tiered\n"
        "from tiered.storage import known_backends\n"
        "k = known_backends()\n"
        "assert {'gpu','cpu','nvme','aiofiles','tensorstore'} <= set(k), k\n"
        "assert k['nvme'].target == 'tiered_nvme:NVMeBackend' and k['nvme'].source == 'entry_point'\n"
        "import tiered.device, tiered.testing, tiered.cli.backends\n"
        "bad = [m for m in sys.modules if m.startswith(('tiered_gpu','tiered_cpu','tiered_nvme','tiered_aio','tiered_tensor'))]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.parametrize("name", ["gpu", "cpu", "nvme", "aiofiles", "tensorstore"])
def test_builtin_classes_load_by_name(name: str) -> None:
    cls = get_backend_class(name)
    assert issubclass(cls, StorageBackend) and cls.name == name


def test_unknown_backend_lists_known_and_nearest() -> None:
    with pytest.raises(
        BackendNotFoundError,
        match=r"'nvmee'.*Did you mean 'nvme'.*Known backends: aiofiles, .*cpu, .*nvme, .*tensorstore",
    ) as info:
        open_backend({"type": "nvmee", "path": "/x"})
    assert isinstance(info.value, KeyError)


def test_import_failure_carries_install_hint() -> None:
    register_backend(
        "needs-extra", "tiered_no_such_module_xyz:Backend", install_hint="pip install tiered-xyz"
    )
    try:
        assert "needs-extra" in known_backends()  # registration did not import
        with pytest.raises(BackendImportError, match=r"'needs-extra'.*pip install tiered-xyz") as info:
            open_backend("needs-extra")
        assert isinstance(info.value, ImportError)
    finally:
        unregister_backend("needs-extra")


def test_target_that_is_not_a_backend() -> None:
    register_backend("not-a-backend", "collections:OrderedDict")
    register_backend("no-attr", "collections:NoSuchThing")
    try:
        with pytest.raises(BackendImportError, match="not a tiered.storage.StorageBackend subclass"):
            get_backend_class("not-a-backend")
        with pytest.raises(BackendImportError, match="no attribute 'NoSuchThing'"):
            get_backend_class("no-attr")
    finally:
        unregister_backend("not-a-backend")
        unregister_backend("no-attr")


def test_register_rejects_non_backends() -> None:
    with pytest.raises(ConfigError, match="StorageBackend subclass"):
        register_backend("weird", dict)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="name"):
        register_backend("", DictBackend)


def test_register_refuses_a_taken_name_unless_clobber() -> None:
    """fsspec's rule: a name already known (an entry point, or registered) is replaced only with
    clobber=True; the same target again is fine."""
    with pytest.raises(
        BackendExistsError, match=r"'cpu' is already taken by 'tiered_cpu:PinnedCPUBackend'.*clobber=True"
    ):
        register_backend("cpu", DictBackend)
    assert get_backend_class("cpu").__name__ == "PinnedCPUBackend"
    register_backend("dictmem", DictBackend)
    register_backend("dictmem", DictBackend)  # the same class again: no error
    with pytest.raises(BackendExistsError, match="register_backend"):
        register_backend("dictmem", "collections:OrderedDict")
    assert get_backend_class("dictmem") is DictBackend
    register_backend("dictmem", "collections:OrderedDict", clobber=True)
    assert known_backends()["dictmem"].target == "collections:OrderedDict"


def test_register_overrides_entry_point_and_unregister_restores() -> None:
    register_backend("cpu", DictBackend, clobber=True)
    try:
        assert isinstance(open_backend("cpu"), DictBackend)
        assert known_backends()["cpu"].source == "register_backend"
    finally:
        unregister_backend("cpu")
    assert get_backend_class("cpu").__name__ == "PinnedCPUBackend"


def test_wrong_and_missing_options_are_config_errors() -> None:
    register_backend("dictmem", DictBackend)
    with pytest.raises(ConfigError, match=r"'lable'.*Did you mean 'label'.*Accepted options: label"):
        open_backend({"type": "dictmem", "lable": "x"})
    with pytest.raises(ConfigError, match=r"missing required option\(s\) 'path'"):
        open_backend({"type": "nvme"})
    with pytest.raises(ConfigError, match="no 'type' key"):
        open_backend({"path": "/x"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        open_backend("{not json")
    with pytest.raises(ConfigError, match="must be a dict"):
        open_backend(42)  # type: ignore[arg-type]


def test_string_and_json_specs() -> None:
    register_backend("dictmem", DictBackend)
    assert open_backend("dictmem").spec() == {"type": "dictmem", "label": "default"}
    b = open_backend('{"type": "dictmem", "label": "j"}')
    assert b.spec() == {"type": "dictmem", "label": "j"}
    assert asyncio.run(b.exists("k")) is False


def test_public_names_exported_from_tiered() -> None:
    assert tiered.register_backend is register_backend and tiered.open_backend is open_backend
    assert {"register_backend", "open_backend"} <= set(tiered.__all__)


def test_third_party_entry_point_is_found_and_loaded_lazily(monkeypatch) -> None:
    from importlib import metadata

    from tiered.storage import registry

    fake = metadata.EntryPoint(
        name="ep-dict", value="tests.test_storage_registry:DictBackend", group="tiered.backends"
    )
    real = metadata.entry_points

    def entry_points(**kw):
        found = list(real(**kw))
        return found + [fake] if kw.get("group") == "tiered.backends" else found

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_entry_points", None)  # re-read the group
    try:
        info = known_backends()["ep-dict"]
        assert info.source == "entry_point" and info.target == fake.value
        assert type(open_backend({"type": "ep-dict", "label": "x"})).__name__ == "DictBackend"
    finally:
        registry._classes.pop("ep-dict", None)
        registry._entry_points = None


def test_capabilities_default_to_the_class_attribute_or_say_what_to_set() -> None:
    from tiered.storage.base import Capacity, StorageBackend

    class Minimal(StorageBackend):
        async def write(self, key, tensor): ...
        async def read(self, key, out): ...
        async def delete(self, key): ...
        async def exists(self, key):
            return False

        def capacity(self):
            return Capacity(None, None)

    with pytest.raises(NotImplementedError, match="static_capabilities"):
        Minimal().capabilities  # noqa: B018
    Minimal.static_capabilities = Capabilities(persistent=True, memory_like=False)
    assert Minimal().capabilities.persistent is True


def test_registered_under_another_name_round_trips_its_spec() -> None:
    # the class says "dictmem"; registered as "aliasmem" only, its spec must still reopen it
    register_backend("aliasmem", DictBackend)
    try:
        b = open_backend({"type": "aliasmem", "label": "x"})
        assert b.spec()["type"] == "aliasmem"
        again = open_backend(b.spec())
        assert type(again) is DictBackend and again.spec() == b.spec()
        assert DictBackend.name == "dictmem"  # the class default is untouched
    finally:
        unregister_backend("aliasmem")
