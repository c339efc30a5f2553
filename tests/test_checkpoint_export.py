"""engine.save_pretrained: a Hugging Face directory that from_pretrained loads with identical weights."""

from __future__ import annotations

import copy
import importlib
import json
import os
from pathlib import Path

import pytest
import torch
from checkpoint_support import train
from engine_support import CASES, build, ds_config, make_batches
from safetensors import safe_open

import tiered


def _trained(tmp_path: Path, case_name: str, **kw: object) -> tiered.Engine:
    case = CASES[case_name]
    e = tiered.initialize(
        build(case), ds_config(param="nvme", opt="cpu", nvme_path=str(tmp_path / "nvme"), **kw)
    )
    train(e, case, make_batches(case, 2, 4))
    return e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_pretrained_loads_the_trained_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    with _trained(tmp_path, "llama") as e:
        want = e.state_dict_fp32()
        out = e.save_pretrained(tmp_path / "hf", dtype=dtype, max_shard_size="40KB")
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "config.json" in files and "model.safetensors.index.json" in files and len(shards) >= 2
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) >= set(want) and set(index["weight_map"].values()) == set(shards)
    for f in shards:
        with safe_open(os.path.join(out, f), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            # max_shard_size holds unless one tensor alone is larger (the embedding: 64x32x4 B)
            assert sum(fh.get_tensor(k).nbytes for k in fh.keys()) <= max(40_000, 64 * 32 * 4)
    loaded = AutoModelForCausalLM.from_pretrained(out, torch_dtype=dtype)
    got = dict(loaded.named_parameters())
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k].detach(), v.to(dtype)), k


def test_one_shard_and_a_reexport_replaces_the_old_shards(tmp_path: Path) -> None:
    with _trained(tmp_path, "gpt2") as e:  # tied embeddings: written once, tied again on load
        e.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
        assert len([f for f in os.listdir(tmp_path / "hf") if f.startswith("model-")]) > 1
        e.save_pretrained(tmp_path / "hf")  # one shard at the default max_shard_size
        want = e.state_dict_fp32()
    files = sorted(os.listdir(tmp_path / "hf"))
    assert [f for f in files if "safetensors" in f] == ["model.safetensors"], files
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16)
    for k, v in loaded.named_parameters():
        assert torch.equal(v.detach(), want[k].to(torch.bfloat16)), k


def test_gathered_parameters_reads_and_modifies_every_copy(tmp_path: Path) -> None:
    case = CASES["llama"]
    with _trained(tmp_path, "llama", dtype="bf16") as e:
        head = e.module.lm_head.weight
        assert head.numel() == 0  # partitioned outside forward
        want = e.state_dict_fp32()["lm_head.weight"]
        with e.gathered_parameters(e.module.lm_head):
            assert torch.equal(head.detach(), want) and float(head.detach().sum()) != 0.0
        assert head.numel() == 0
        with e.gathered_parameters([head], modify=True):
            head.data.fill_(0.5)
        with e.gathered_parameters(head):
            assert bool((head == 0.5).all())
        # the fp32 master was written too: one more step starts from 0.5, not from the old values
        train(e, case, make_batches(case, 1, 4, seed=5))
        after = e.state_dict_fp32()["lm_head.weight"].float()
        assert float((after - 0.5).abs().max()) < 0.01
        with pytest.raises(ValueError, match="not parameters this engine manages"):
            with e.gathered_parameters([torch.nn.Parameter(torch.zeros(2))]):
                pass


def test_close_gives_the_module_its_trained_weights_back(tmp_path: Path) -> None:
    case = CASES["llama"]
    model = build(case)
    e = tiered.initialize(model, ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme")))
    train(e, case, make_batches(case, 2, 4))
    want = e.state_dict_fp32()
    e.close()
    got = dict(model.named_parameters())
    assert all(torch.equal(got[k].detach(), v) for k, v in want.items())
    batch = make_batches(case, 1, 2)[0]
    assert torch.isfinite(model(**batch).loss)  # plain PyTorch use again
    model.save_pretrained(tmp_path / "plain")  # and HF's own export
    # nothing of tiered's is left on it: torch.save of the whole module and deepcopy work
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(torch.equal(p.detach(), want[k]) for k, p in loaded.named_parameters())
    assert all(torch.equal(p.detach(), want[k]) for k, p in copy.deepcopy(model).named_parameters())
    assert not [k for m in model.modules() for k in vars(m) if "tiered" in k]
    model2 = build(case)
    e2 = tiered.initialize(model2, ds_config(param="cpu", opt="cpu"))
    e2.close(restore_weights=False)  # the opt-out for models that do not fit in memory
    assert all(p.numel() == 0 for p in model2.parameters())


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_export_grows_rss_by_about_one_group(tmp_path: Path) -> None:
    """64 MiB of fp32 weights on NVMe in 4 MiB groups: the export gathers one group at a time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    config = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"), sub_group_size=1 << 20)
    with tiered.initialize(model, config) as e:
        importlib.import_module("tiered.checkpoint.export")  # its first import is not the export's memory
        Path("/proc/self/clear_refs").write_text("5")
        base = _vm_kib("VmRSS")
        e.save_pretrained(tmp_path / "hf", dtype=torch.float32, max_shard_size="16MiB")
        growth = (_vm_kib("VmHWM") - base) * 1024
        e.close(restore_weights=False)
    print(f"rss growth while exporting: {growth / 2**20:.1f} MiB for a 64 MiB model")
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) == 4
    bound = 4 * (4 << 20) + (16 << 20)  # a few groups + allocator slack, far below the 64 MiB model
    assert growth <= bound, (
        f"RSS grew by {growth / 2**20:.1f} MiB while exporting (bound {bound / 2**20:.0f} MiB)"
    )
