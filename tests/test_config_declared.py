"""One declaration per config key ([Note: one declaration per key] in tiered/config/declare.py):
the parser's defaults, its key names, the dump, the "auto" table and docs/config.md all agree
with the schema field's `key(...)`, for every declared key."""

from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered.config import TieredConfig, TieredSection, ZeroConfig, dump_config, load_config
from tiered.config.auto import HIDDEN_SIZE_FORMULAS
from tiered.config.declare import KeyDecl, declared_fields, field_default
from tiered.config.keys import DECLARED, RULES, markdown_table
from tiered.errors import ConfigError, UnsupportedConfigError

ROOT = Path(__file__).resolve().parents[1]
ZP = "zero_optimization"
_FIELDS = {attr: (f, decl) for attr, f, decl in declared_fields(TieredConfig)}

# Fields that are not one key each, and where they are read and written (loader, dump).
_COMPOSITE = {
    "precision.dtype": "bf16.enabled / fp16.enabled",
    "tiered.tiers": "the tiered.tiers section ([Note: default tiers])",
    "scheduler": "the scheduler section (params per type in config/scheduler.py)",
    "unset": "the keys left to the caller ([Note: caller-supplied hyper-parameters])",
    "tiered.io_retry_errno_codes": "io_retry_errnos as codes, computed on construction",
}


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _put(out: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, leaf = path.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def _leaf_fields(cls: type, owner: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        attr = f"{owner}.{f.name}" if owner else f.name
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory()):
            out.extend(_leaf_fields(type(f.default_factory()), attr))
        else:
            out.append(attr)
    return out


def test_every_schema_field_declares_its_key_or_is_composite() -> None:
    undeclared = [a for a in _leaf_fields(TieredConfig) if a not in _FIELDS and a not in _COMPOSITE]
    assert not undeclared, f"schema fields without key(...): {undeclared}"


@pytest.mark.parametrize(
    "raw", [{}, {ZP: {}, "aio": {}, "fp16": {}, "bf16": {}, "tiered": {}}], ids=["none", "empty"]
)
def test_an_empty_config_resolves_to_every_declared_default(raw: dict[str, Any]) -> None:
    """The parser's default for every key is the dataclass default (ZeroConfig.stage was 3 in the
    schema and 0 in the parser; overlap_comm True and `stage == 3`)."""
    cfg, built = load_config(raw), TieredConfig()
    differ = {a: (_attr(cfg, a), _attr(built, a)) for a in _FIELDS if _attr(cfg, a) != _attr(built, a)}
    assert not differ, f"parsed vs dataclass default: {differ}"


def test_zero_defaults_are_deepspeeds() -> None:
    assert (ZeroConfig().stage, ZeroConfig().overlap_comm, ZeroConfig(stage=3).overlap_comm) == (
        0,
        False,
        True,
    )
    ds_config = pytest.importorskip("deepspeed.runtime.zero.config")
    for stage in (0, 3):
        ds = ds_config.DeepSpeedZeroConfig(stage=stage)
        z = ZeroConfig(stage=stage)
        assert (z.stage, z.overlap_comm, z.contiguous_gradients) == (
            ds.stage,
            ds.overlap_comm,
            ds.contiguous_gradients,
        )
    assert ZeroConfig().stage == ds_config.DeepSpeedZeroConfig().stage


def _other_value(decl: KeyDecl, default: Any, tmp: Path) -> tuple[Any, Any, dict[str, Any]]:
    """(JSON value, the field it must give, the rest of the config it needs) for one key."""
    special: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        f"{ZP}.stage": (1, 1, {}),
        f"{ZP}.offload_param.device": ("cpu", "cpu", {ZP: {"stage": 3}}),
        f"{ZP}.offload_param.nvme_path": (str(tmp), str(tmp), {}),
        f"{ZP}.offload_optimizer.device": ("cpu", "cpu", {ZP: {"stage": 1}}),
        f"{ZP}.offload_optimizer.nvme_path": (str(tmp), str(tmp), {}),
        f"{ZP}.offload_optimizer.ratio": (
            0.5,
            0.5,
            {ZP: {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
        ),
        f"{ZP}.overlap_comm": (True, True, {}),
        f"{ZP}.leaf_module.classes": (["Foo"], ("Foo",), {}),
        f"{ZP}.leaf_module.names": (["a.b"], ("a.b",), {}),
        f"{ZP}.leaf_module.name_suffixes": (["b"], ("b",), {}),
        "optimizer.type": ("Adam", "Adam", {}),
        "optimizer.params.betas": ([0.8, 0.99], (0.8, 0.99), {"optimizer": {"type": "AdamW"}}),
        "optimizer.params.adam_w_mode": (False, False, {"optimizer": {"type": "Adam"}}),
        "tiered.trace_path": ("t.json", "t.json", {}),
        "tiered.io_retry_errnos": (["eio"], ("EIO",), {}),
        "tiered.param_tier": ("cpu", "cpu", {ZP: {"stage": 3, "offload_param": {"device": "cpu"}}}),
        "tiered.optimizer_tier": ("cpu", "cpu", {ZP: {"stage": 3, "offload_optimizer": {"device": "cpu"}}}),
        "tiered.grad_tier": ("cpu", "cpu", {ZP: {"stage": 3, "offload_optimizer": {"device": "cpu"}}}),
        "tiered.host_mmap_threshold": ("2MiB", 2 << 20, {}),
        "tiered.optimizer_state_format": ("bf16", "bf16", {}),
        "tiered.nonfinite_step": ("skip", "skip", {}),
        "tiered.residency": ("off", "off", {}),
        "train_batch_size": (8, 8, {}),
        "train_micro_batch_size_per_gpu": (4, 4, {}),
        "communication_data_type": ("bf16", "bf16", {}),
    }
    if decl.path in special:
        return special[decl.path]
    context: dict[str, Any] = {"optimizer": {"type": "AdamW"}} if decl.path.startswith("optimizer.") else {}
    if isinstance(default, bool):
        return not default, not default, context
    if isinstance(default, int):
        value = default + 1 if decl.maximum is None or default + 1 <= decl.maximum else default - 1
        return value, value, context
    if isinstance(default, float):
        return default * 2 + 1, default * 2 + 1, context
    raise AssertionError(f"no test value for {decl.path}: add it to `special`")


@pytest.mark.parametrize("path", sorted(DECLARED))
def test_every_declared_spelling_reaches_its_field(path: str, tmp_path: Path) -> None:
    """Every key (and alias) given a value of its own lands in the field that declares it."""
    f, decl = DECLARED[path]
    attr = next(a for a, (g, d) in _FIELDS.items() if d is decl)
    raw, expected, context = _other_value(decl, field_default(f), tmp_path)
    config = _put(json.loads(json.dumps(context)), path, raw)
    if path == "aio.use_gds" and not torch.cuda.is_available():
        with pytest.raises(UnsupportedConfigError, match="aio.use_gds"):
            load_config(config)
        return
    assert _attr(load_config(config), attr) == expected != field_default(f) or path == f"{ZP}.overlap_comm"


def test_dump_writes_every_declared_key_at_its_path() -> None:
    cfg = load_config({ZP: {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    out = dump_config(cfg)
    for attr, (_, decl) in _FIELDS.items():
        if _attr(cfg, attr) is None and not decl.path.startswith("tiered."):
            continue  # an absent DeepSpeed key is None
        node: Any = out
        for part in decl.path.split("."):
            assert part in node, f"dump_config has no {decl.path}"
            node = node[part]
        assert node == (list(_attr(cfg, attr)) if isinstance(_attr(cfg, attr), tuple) else _attr(cfg, attr))
    assert load_config(out) == cfg


def test_model_auto_table_is_the_declared_one() -> None:
    assert set(HIDDEN_SIZE_FORMULAS) == {d.path for _, d in _FIELDS.values() if d.auto == "model"}


def test_docs_config_table_is_generated_from_the_code() -> None:
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert markdown_table() in doc, (
        "docs/config.md's key table differs from the code: regenerate it with `python -m tiered.config --markdown`"
    )
    assert all(f"`{p}`" in doc for p in RULES)


def test_io_retry_errnos_are_parsed_once_into_codes() -> None:
    t = load_config({"tiered": {"io_retry_errnos": ["eagain", errno.EIO]}}).tiered
    assert (t.io_retry_errnos, t.io_retry_errno_codes) == (
        ("EAGAIN", "EIO"),
        frozenset({errno.EAGAIN, errno.EIO}),
    )
    assert TieredSection().io_retry_errno_codes == frozenset(
        getattr(errno, n) for n in TieredSection.io_retry_errnos
    )
    with pytest.raises(ConfigError, match="tiered.io_retry_errnos.*EFOO"):
        TieredSection(io_retry_errnos=("EFOO",))
