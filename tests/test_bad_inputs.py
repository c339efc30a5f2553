"""A bad-input survey: malformed configs, budgets, backend specs, paths, model folders, data
files, checkpoints and API misuse, each met by its own error class and a message naming the
culprit (the key, file, option or call) - what a new user gets instead of a traceback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import CASES, build, ds_config, make_batches

import tiered
from tiered.config.loader import load_config
from tiered.errors import (
    AlreadyManagedError,
    BackendNotFoundError,
    CapacityError,
    CheckpointNotFoundError,
    ConfigError,
    StorageIOError,
    StorageKeyError,
    StoredSizeError,
)
from tiered.storage import open_backend


def _cfg(**tiered_keys: Any) -> dict[str, Any]:
    cfg = ds_config()
    cfg.setdefault("tiered", {}).update(tiered_keys)
    return cfg


def _with(path: str, value: Any) -> dict[str, Any]:
    """ds_config() with the dotted key `path` set to `value`."""
    cfg = ds_config()
    node = cfg
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return cfg


# (id, config, error class, words the message must contain)
CONFIGS: list[tuple[str, Any, type[BaseException], tuple[str, ...]]] = [
    ("unknown-top-key", _with("trian_batch_size", 4), ConfigError, ("trian_batch_size",)),
    ("unknown-zero-key", _with("zero_optimization.stagee", 3), ConfigError, ("stagee",)),
    ("stage-as-string", _with("zero_optimization.stage", "three"), ConfigError, ("zero_optimization.stage",)),
    ("lr-negative", _with("optimizer.params.lr", -1.0), ConfigError, ("lr",)),
    ("lr-string", _with("optimizer.params.lr", "fast"), ConfigError, ("lr",)),
    ("betas-one", _with("optimizer.params.betas", [0.9]), ConfigError, ("betas",)),
    ("eps-negative", _with("optimizer.params.eps", -1e-8), ConfigError, ("eps",)),
    ("gas-zero", _with("gradient_accumulation_steps", 0), ConfigError, ("gradient_accumulation_steps",)),
    ("clip-negative", _with("gradient_clipping", -1.0), ConfigError, ("gradient_clipping",)),
    # sub_group_size: 0 is valid, with DeepSpeed's meaning (one parameter per sub-group): see
    # [Note: zeros keep DeepSpeed's meaning]; -1 is the bad value.
    ("sub-group-negative", _with("zero_optimization.sub_group_size", -1), ConfigError, ("sub_group_size",)),
    (
        "offload-device-bad",
        _with("zero_optimization.offload_param", {"device": "tape"}),
        ConfigError,
        ("offload_param",),
    ),
    ("timeout-zero", _cfg(timeout_s=0), ConfigError, ("tiered.timeout_s",)),
    ("timeout-string", _cfg(timeout_s="long"), ConfigError, ("tiered.timeout_s",)),
    ("io-threads-zero", _cfg(io_threads=0), ConfigError, ("tiered.io_threads",)),
    ("verify-string", _cfg(verify_checksums="yes"), ConfigError, ("tiered.verify_checksums",)),
    ("floor-zero", _cfg(io_timeout_floor_s=0), ConfigError, ("tiered.io_timeout_floor_s",)),
    ("rate-negative", _cfg(io_min_bytes_per_s=-5), ConfigError, ("tiered.io_min_bytes_per_s",)),
    ("retries-negative", _cfg(io_retries=-1), ConfigError, ("tiered.io_retries",)),
    ("retries-float", _cfg(io_retries=1.5), ConfigError, ("tiered.io_retries",)),
    ("backoff-negative", _cfg(io_retry_backoff_s=-0.1), ConfigError, ("tiered.io_retry_backoff_s",)),
    ("errno-unknown", _cfg(io_retry_errnos=["EFOO"]), ConfigError, ("tiered.io_retry_errnos", "EFOO")),
    ("errnos-not-list", _cfg(io_retry_errnos="EAGAIN"), ConfigError, ("tiered.io_retry_errnos",)),
    ("unknown-tiered-key", _cfg(verify_checksum=True), ConfigError, ("verify_checksum",)),
    ("param-tier-unknown", _cfg(param_tier="tape"), ConfigError, ("tiered.param_tier", "tape")),
    ("tiers-not-object", _cfg(tiers=[1, 2]), ConfigError, ("tiered.tiers",)),
    ("tier-backend-string", _cfg(tiers={"x": {"backend": "nvme"}}), ConfigError, ("tiered.tiers.x.backend",)),
    ("budget-unit", _cfg(tiers={"cpu": {"budget": "12XB"}}), ConfigError, ("12XB",)),
    ("budget-negative", _cfg(tiers={"cpu": {"budget": "-1GiB"}}), ConfigError, ("-1GiB",)),
    ("budget-bool", _cfg(tiers={"cpu": {"budget": True}}), ConfigError, ("budget",)),
    (
        "fp16-and-bf16",
        {**ds_config(), "fp16": {"enabled": True}, "bf16": {"enabled": True}},
        ConfigError,
        ("fp16", "bf16"),
    ),
]


def _case(c: Any) -> Any:
    if hasattr(c, "marks"):  # a pytest.param (itself a tuple) carrying a mark
        return pytest.param(*c.values[1:], id=c.values[0], marks=c.marks)
    return pytest.param(*c[1:], id=c[0])


@pytest.mark.parametrize("cfg,cls,words", [_case(c) for c in CONFIGS])
def test_a_bad_config_names_its_key(
    cfg: dict[str, Any], cls: type[BaseException], words: tuple[str, ...]
) -> None:
    with pytest.raises(cls) as info:
        load_config(cfg)
    msg = str(info.value)
    assert all(w in msg for w in words), msg


def test_a_config_file_that_is_not_json(tmp_path: Path) -> None:
    p = tmp_path / "ds.json"
    p.write_text("{ 'stage': 3 ")
    with pytest.raises(ConfigError) as info:
        load_config(str(p))
    assert str(p) in str(info.value)


def test_a_config_file_that_does_not_exist(tmp_path: Path) -> None:
    p = tmp_path / "missing.json"
    with pytest.raises((ConfigError, FileNotFoundError)) as info:
        load_config(str(p))
    assert str(p) in str(info.value)


# ---- backend specs ------------------------------------------------------------------------------
def _specs(tmp: Path) -> list[tuple[str, Any, type[BaseException], tuple[str, ...]]]:
    (tmp / "file").write_text("x")
    return [
        ("unknown-type", {"type": "nvmee"}, BackendNotFoundError, ("nvmee",)),
        ("code-string", {"type": "os:system"}, BackendNotFoundError, ("os:system", "register_backend")),
        ("no-type", {"path": str(tmp)}, ConfigError, ("type",)),
        ("unknown-option", {"type": "nvme", "path": str(tmp), "pth": 1}, ConfigError, ("pth",)),
        ("missing-path", {"type": "nvme"}, ConfigError, ("path",)),
        ("path-missing", {"type": "nvme", "path": str(tmp / "nope")}, StorageIOError, (str(tmp / "nope"),)),
        ("path-is-file", {"type": "nvme", "path": str(tmp / "file")}, StorageIOError, (str(tmp / "file"),)),
        (
            "faults-kind",
            {"type": "faults", "inner": "cpu", "faults": [{"kind": "bitfip"}]},
            ConfigError,
            ("bitflip",),
        ),
        ("faults-no-inner", {"type": "faults"}, ConfigError, ("inner",)),
        ("faults-seed", {"type": "faults", "inner": "cpu", "seed": "x"}, ConfigError, ("seed",)),
        (
            "faults-prob",
            {"type": "faults", "inner": "cpu", "faults": [{"kind": "error", "op": "read", "probability": 2}]},
            ConfigError,
            ("probability",),
        ),
        (
            "stripe-both",
            {"type": "stripe", "paths": [str(tmp)], "members": ["cpu"]},
            ConfigError,
            ("members", "paths"),
        ),
        (
            "stripe-bytes",
            {"type": "stripe", "paths": [str(tmp)], "stripe_bytes": 0},
            ConfigError,
            ("stripe_bytes",),
        ),
    ]


@pytest.mark.parametrize("index", range(13))
def test_a_bad_backend_spec_names_its_option(tmp_path: Path, index: int) -> None:
    _, spec, cls, words = _specs(tmp_path)[index]
    with pytest.raises(cls) as info:
        open_backend(spec)
    msg = str(info.value)
    assert all(w in msg for w in words), msg


# ---- keys ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["../escape", "a/b", "", ".", "..", "k" * 201, "sp ace", "x\x00y"])
def test_a_bad_key_is_a_storage_key_error_naming_it(tmp_path: Path, key: str) -> None:
    async def go() -> None:
        b = open_backend({"type": "nvme", "path": str(tmp_path)})
        try:
            with pytest.raises(StorageKeyError, match="invalid storage key"):
                await b.write(key, torch.zeros(2))
        finally:
            await b.close()

    asyncio.run(go())
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_a_read_into_the_wrong_size_names_both_sizes(tmp_path: Path) -> None:
    async def go() -> None:
        b = open_backend({"type": "nvme", "path": str(tmp_path)})
        try:
            await b.write("w", torch.zeros(4))
            with pytest.raises(StoredSizeError, match=r"'w'.*16 bytes.*8 bytes"):
                await b.read("w", torch.zeros(2))
        finally:
            await b.close()

    asyncio.run(go())


# ---- initialize, budgets, API misuse ------------------------------------------------------------
def test_initialize_with_no_module() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        tiered.initialize({"w": torch.zeros(2)}, ds_config())  # type: ignore[arg-type]


def test_initialize_twice_on_one_module() -> None:
    model = build(CASES["mlp"])
    with tiered.initialize(model, ds_config()):
        with pytest.raises(AlreadyManagedError, match="already managed"):
            tiered.initialize(model, ds_config())


@pytest.mark.parametrize("tier", ["cpu", "gpu"])
def test_a_budget_larger_than_the_machine(tier: str) -> None:
    cfg = ds_config(**{f"{tier}_budget": "1000PB"})
    with pytest.raises(CapacityError, match=rf"tiered\.tiers\.{tier}\.budget .* has in all"):
        tiered.initialize(build(CASES["mlp"]), cfg)


def test_a_gpu_budget_too_small_for_the_largest_module() -> None:
    with pytest.raises(CapacityError, match="largest module"):
        tiered.initialize(build(CASES["mlp"]), ds_config(gpu_budget="1KiB"))


def test_a_tier_name_with_a_slash_at_initialize() -> None:
    cfg = ds_config()
    cfg["tiered"] = {"tiers": {"a/b": {"backend": {"type": "cpu"}}}}
    with pytest.raises(ValueError, match="tier name 'a/b'"):
        tiered.initialize(build(CASES["mlp"]), cfg)


def test_an_unknown_tier_backend_at_initialize(tmp_path: Path) -> None:
    cfg = ds_config()
    cfg["tiered"] = {"tiers": {"x": {"backend": {"type": "no-such"}}}}
    with pytest.raises(BackendNotFoundError, match="no-such"):
        tiered.initialize(build(CASES["mlp"]), cfg)


def test_nvme_path_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(f), mkdir=False)
    with pytest.raises((ConfigError, StorageIOError)) as info:
        tiered.initialize(build(CASES["mlp"]), cfg)
    assert str(f) in str(info.value)


def test_step_without_backward() -> None:
    case = CASES["mlp"]
    with tiered.initialize(build(case), ds_config()) as engine:
        engine(**make_batches(case, 1, 4)[0])
        with pytest.raises(RuntimeError, match=r"engine\.backward\(loss\)"):
            engine.step()


@pytest.mark.parametrize("how", ["tmpfs-ro", "bind-ro"])
def test_nvme_path_on_a_read_only_filesystem_says_so(tmp_path: Path, how: str) -> None:
    """Root only (a read-only mount; chmod cannot fake EROFS, and root ignores modes)."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    if how == "tmpfs-ro":
        cmd = ["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs", str(ro)]
    else:
        (tmp_path / "src").mkdir()
        cmd = ["mount", "--bind", "-o", "ro", str(tmp_path / "src"), str(ro)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        if how == "bind-ro" and os.access(ro, os.W_OK) and not os.statvfs(ro).f_flag & os.ST_RDONLY:
            pytest.skip("this kernel ignores ro on a bind mount")
        cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(ro), mkdir=False)
        with pytest.raises((ConfigError, StorageIOError)) as info:
            tiered.initialize(build(CASES["mlp"]), cfg)
        msg = str(info.value)
        assert str(ro) in msg and "read-only filesystem" in msg, msg
        assert "permissions" not in msg, msg
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fp32_inputs_to_a_16_bit_model_name_the_input_the_module_and_the_fix(dtype: str) -> None:
    from tiered.errors import InputDtypeError

    with tiered.initialize(build(CASES["mlp"]), ds_config(dtype=dtype)) as engine:
        with pytest.raises(InputDtypeError) as info:
            engine(x=torch.randn(4, 16), y=torch.randn(4, 8))
    msg = str(info.value)
    want = "float16" if dtype == "fp16" else "bfloat16"
    assert "MLP.forward: input 'x'" in msg and "torch.float32" in msg and f".to(torch.{want})" in msg, msg
    assert (dtype == "fp16") == ("auto_cast" in msg), msg


def test_the_module_after_close_is_a_plain_module_again() -> None:
    case = CASES["mlp"]
    model = build(case)
    b = make_batches(case, 1, 4)[0]
    engine = tiered.initialize(model, ds_config())
    engine.backward(case.loss(engine(**b)))
    engine.step()
    trained = engine.state_dict_fp32()
    engine.close()
    assert torch.equal(model.inp.weight, trained["inp.weight"])
    model(**b).backward()  # plain PyTorch use: forward and backward work
    with pytest.raises(RuntimeError, match="Engine is closed"):
        engine(**b)


def test_the_module_after_close_without_its_weights_says_what_happened() -> None:
    from tiered.errors import ParameterNotGatheredError

    case = CASES["mlp"]
    model = build(case)
    b = make_batches(case, 1, 4)[0]
    tiered.initialize(model, ds_config()).close(restore_weights=False)
    with pytest.raises(ParameterNotGatheredError, match=r"MLP was closed .*restore_weights=False.*empty"):
        model(**b)
    fresh = dict(build(case).named_parameters())
    for name, p in model.named_parameters():  # weights back: the guard goes
        p.data = fresh[name].data
    model(**b)


def test_an_all_frozen_model_is_refused_at_initialize() -> None:
    model = build(CASES["mlp"])
    model.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"every parameter of MLP is frozen.*unfreeze"):
        tiered.initialize(model, ds_config())


def test_load_checkpoint_from_a_missing_folder(tmp_path: Path) -> None:
    with tiered.initialize(build(CASES["mlp"]), ds_config()) as engine:
        with pytest.raises(CheckpointNotFoundError) as info:
            engine.load_checkpoint(tmp_path / "none")
        assert str(tmp_path / "none") in str(info.value)


def test_load_checkpoint_with_an_unknown_tag(tmp_path: Path) -> None:
    case = CASES["mlp"]
    with tiered.initialize(build(case), ds_config()) as engine:
        b = make_batches(case, 1, 4)[0]
        engine.backward(case.loss(engine(**b)))
        engine.step()
        engine.save_checkpoint(tmp_path, tag="a")
        with pytest.raises(CheckpointNotFoundError, match=r"nope does not exist"):
            engine.load_checkpoint(tmp_path, tag="nope")


# ---- data files and model folders ---------------------------------------------------------------
def _read(path: Path, **kw: Any) -> list[Any]:
    from tiered.finetune.data_sources import read_records

    return list(read_records(path, **kw))


DATA: list[tuple[str, str, str, Callable[[Path], Any]]] = [
    ("jsonl-bad-line", "d.jsonl", '{"text": "a"}\n{not json}\n', lambda p: _read(p)),
    ("jsonl-no-text", "d.jsonl", '{"body": "a"}\n', lambda p: _read(p)),
    ("jsonl-text-not-str", "d.jsonl", '{"text": 5}\n', lambda p: _read(p)),
    ("jsonl-custom-field", "d.jsonl", '{"text": "a"}\n', lambda p: _read(p, text_field="content")),
]


@pytest.mark.parametrize("name,body,call", [d[1:] for d in DATA], ids=[d[0] for d in DATA])
def test_a_bad_data_file_names_the_file(
    tmp_path: Path, name: str, body: str, call: Callable[[Path], Any]
) -> None:
    p = tmp_path / name
    p.write_text(body)
    with pytest.raises((ValueError, KeyError, TypeError)) as info:
        call(p)
    assert name in str(info.value), str(info.value)


def test_a_missing_data_path(tmp_path: Path) -> None:
    with pytest.raises((FileNotFoundError, ValueError)) as info:
        _read(tmp_path / "gone.jsonl")
    assert "gone.jsonl" in str(info.value)


@pytest.mark.parametrize(
    "files",
    [{}, {"config.json": "{not json"}, {"config.json": json.dumps({"model_type": "no-such-arch"})}],
    ids=["empty-folder", "config-not-json", "unknown-model-type"],
)
def test_a_bad_model_folder_names_the_folder(tmp_path: Path, files: dict[str, str]) -> None:
    from tiered.finetune.model import load_hf_config, resolve_model

    for n, body in files.items():
        (tmp_path / n).write_text(body)
    with pytest.raises((ValueError, FileNotFoundError, OSError, KeyError)) as info:
        load_hf_config(resolve_model(tmp_path))
    assert str(tmp_path) in str(info.value) or "config.json" in str(info.value), str(info.value)
