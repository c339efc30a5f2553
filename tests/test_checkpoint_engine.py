"""engine.save_checkpoint / load_checkpoint: bad input, RNG states, a full disk, memory while saving."""

from __future__ import annotations

import errno
import importlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from checkpoint_support import full_state, train
from engine_support import CASES, MLP, build, ds_config, make_batches

import tiered
from tiered.checkpoint import read_latest, read_parameters, stream
from tiered.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSpaceError,
)

CASE = CASES["mlp"]


def _engine(tmp_path: Path, model: nn.Module | None = None, **kw: object) -> tiered.Engine:
    config = ds_config(param="cpu", opt="nvme", nvme_path=str(tmp_path / "nvme"), **kw)  # type: ignore[arg-type]
    return tiered.initialize(model if model is not None else build(CASE), config)


def test_manifest_records_layout_counters_config_and_checksums(tmp_path: Path) -> None:
    with _engine(tmp_path, sub_group_size=1000) as e:
        train(e, CASE, make_batches(CASE, 2, 4))
        path = e.save_checkpoint(tmp_path / "ck", tag="mine", client_state={"note": "x"})
        params = e.state_dict_fp32()
    m = json.loads((Path(path) / "manifest.json").read_text())
    assert m["tag"] == "mine" and m["world_size"] == 1 and m["format_version"] == 2
    assert m["training"]["global_steps"] == 2 and m["training"]["optimizer_step"] == 2
    assert m["config"]["zero_optimization"]["sub_group_size"] == 1000
    assert set(m["files"]) == {"rank00000.safetensors"} and "xxh3_64" in m["files"]["rank00000.safetensors"]
    assert set(m["parameters"]) == set(params) and m["client_state"] == {"note": "x"}
    assert len(m["ranks"][0]["groups"]) > 1 and "python" in m["ranks"][0]["rng"]
    assert read_latest(tmp_path / "ck") == "mine"
    with _engine(tmp_path) as e:
        e.save_checkpoint(tmp_path / "ck", tag="side", save_latest=False)
    assert read_latest(tmp_path / "ck") == "mine" and (tmp_path / "ck" / "side" / "manifest.json").is_file()
    whole = read_parameters(tmp_path / "ck", kind="master")  # consolidated without an engine
    assert all(torch.equal(whole[k], v) for k, v in params.items())


def test_rng_states_are_restored(tmp_path: Path) -> None:
    with _engine(tmp_path) as e:
        train(e, CASE, make_batches(CASE, 1, 4))
        torch.manual_seed(3), random.seed(3), np.random.seed(3)
        e.save_checkpoint(tmp_path / "ck")
        want = (torch.rand(4), random.random(), np.random.rand())
        torch.manual_seed(11), random.seed(11), np.random.seed(11)
        e.load_checkpoint(tmp_path / "ck")
        got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_another_model_is_refused_naming_what_differs(tmp_path: Path) -> None:
    with _engine(tmp_path) as e:
        train(e, CASE, make_batches(CASE, 1, 4))
        e.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(0)
    with _engine(tmp_path, model=MLP(hidden=32)) as e:
        with pytest.raises(
            CheckpointMismatchError,
            match=r"shapes differ: inp\.weight: \(48, 16\) in the checkpoint, "
            r"\(32, 16\) here",
        ):
            e.load_checkpoint(tmp_path / "ck")
    other = nn.Sequential(nn.Linear(16, 8))
    with _engine(tmp_path, model=other) as e:
        with pytest.raises(
            CheckpointMismatchError, match=r"2 parameters of this model are not in it \(0\.weight"
        ):
            e.load_checkpoint(tmp_path / "ck")
    with _engine(tmp_path, model=build(CASES["llama"]), dtype="bf16") as e:
        with pytest.raises(
            CheckpointMismatchError,
            match="compute dtype torch.float32 in the checkpoint, torch.bfloat16 here",
        ):
            e.load_checkpoint(tmp_path / "ck")


def test_config_changes_are_named_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with _engine(tmp_path) as e:
        train(e, CASE, make_batches(CASE, 1, 4))
        e.save_checkpoint(tmp_path / "ck")
    with _engine(tmp_path, lr=5e-4) as e:
        e.load_checkpoint(tmp_path / "ck")
    assert "optimizer.params.lr: 0.001 -> 0.0005" in caplog.text


def test_corrupt_file_is_named_and_missing_checkpoints_are_errors(tmp_path: Path) -> None:
    with _engine(tmp_path) as e:
        train(e, CASE, make_batches(CASE, 1, 4))
        path = e.save_checkpoint(tmp_path / "ck")
        f = Path(path) / "rank00000.safetensors"
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x55
        f.write_bytes(bytes(data))
        with pytest.raises(CheckpointCorruptError, match="rank00000.safetensors fails its checksum"):
            e.load_checkpoint(tmp_path / "ck")
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            e.load_checkpoint(tmp_path / "nowhere")
        with pytest.raises(CheckpointNotFoundError, match="global_step7 does not exist"):
            e.load_checkpoint(tmp_path / "ck", tag="global_step7")


def test_save_inside_an_accumulation_window_or_with_a_step_in_flight_raises(tmp_path: Path) -> None:
    batches = make_batches(CASE, 2, 4, gas=2)
    with _engine(tmp_path, gas=2) as e:
        loss = e(**batches[0])
        e.backward(loss)
        e.step()
        with pytest.raises(RuntimeError, match="inside a gradient accumulation window"):
            e.save_checkpoint(tmp_path / "ck")
    config = ds_config(param="cpu", opt="nvme", nvme_path=str(tmp_path / "nvme"))
    config["tiered"] = {"overlap_step_with_backward": True}
    with tiered.initialize(build(CASE), config) as e:
        e.backward(e(**batches[0]))
        assert e.optimizer.overlapped_step_running
        with pytest.raises(RuntimeError, match="step began in backward and is still updating"):
            e.save_checkpoint(tmp_path / "ck")
        e.step()
        e.save_checkpoint(tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck" / ".global_step1.partial")


def test_client_state_must_be_json_or_tensors(tmp_path: Path) -> None:
    """Tensors go into the safetensors file ([Note: checkpoint keywords]); anything else but JSON
    is refused (no pickle)."""
    with _engine(tmp_path) as e:
        with pytest.raises(ValueError, match=r"client_state\['opt'\] holds a Thing"):
            e.save_checkpoint(tmp_path / "ck", client_state={"opt": Thing()})
        assert not (tmp_path / "ck").exists()
        e.save_checkpoint(tmp_path / "ck", tag="t", client_state={"opt": torch.arange(3.0), "n": 1})
        _, state = e.load_checkpoint(tmp_path / "ck", tag="t")
    assert torch.equal(state["opt"], torch.arange(3.0)) and state["n"] == 1


class Thing:
    pass


def test_a_full_disk_during_an_engine_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = make_batches(CASE, 3, 4)
    with _engine(tmp_path) as e:
        train(e, CASE, batches[:1])
        e.save_checkpoint(tmp_path / "ck")
        before = full_state(e)
        train(e, CASE, batches[1:2])
        real, seen = stream._raw_write, [0]

        def filling(fd: int, data: memoryview) -> int:
            seen[0] += len(data)
            if seen[0] > 6000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data)

        monkeypatch.setattr(stream, "_raw_write", filling)
        with pytest.raises(CheckpointSpaceError, match="global_step2.partial/rank00000.safetensors"):
            e.save_checkpoint(tmp_path / "ck")
        monkeypatch.undo()
        assert sorted(os.listdir(tmp_path / "ck")) == [".lock", "global_step1", "latest"]
        e.load_checkpoint(tmp_path / "ck")  # verifies checksums
        after = full_state(e)
    assert after["counters"] == before["counters"]
    assert all(torch.equal(after["opt"][k], v) for k, v in before["opt"].items())


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_saving_grows_rss_by_a_few_buffers_only(tmp_path: Path) -> None:
    """~100 MB of NVMe-resident state in 4 MB partitions: a save reads one partition at a time, so
    the peak RSS during it rises by a few partitions, not by the state's size."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    config = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), sub_group_size=1 << 20)
    with tiered.initialize(model, config) as e:
        x = torch.randn(2, 1024)
        e.backward(e(x).square().mean())
        e.step()
        e.flush()
        state_bytes = sum(
            p.nbytes
            for parts in e.optimizer.checkpoint_partitions().values()
            for p in {id(q): q for q in parts.values()}.values()
        )
        largest = max(p.nbytes for p in e.tm.partitions())
        importlib.import_module(
            "tiered.checkpoint.engine_state"
        )  # its first import (numpy, ...) is not the save's
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        base = _vm_kib("VmRSS")
        e.save_checkpoint(tmp_path / "ck")
        growth = (_vm_kib("VmHWM") - base) * 1024
    print(f"rss growth while saving: {growth / 2**20:.1f} MiB for {state_bytes / 2**20:.0f} MiB of state")
    assert state_bytes >= 96 << 20 and largest == 4 << 20
    bound = 4 * largest + 2 * (16 << 20)  # a few partitions + the writer's chunks + allocator slack
    assert growth <= bound, (
        f"RSS grew by {growth / 2**20:.1f} MiB while saving (bound {bound / 2**20:.0f} MiB)"
    )
