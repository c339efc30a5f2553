"""Checkpoints on a CUDA GPU (run by benchmarks/gpu_check): the "gpu" tier is device memory, so
a save copies device partitions to the host through the bounded staging buffer and a load
copies them back; resume stays bit-exact and the export loads in transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import CASES, build, ds_config, make_batches
from test_checkpoint_resume import SCHEDULER, _resume_equals_uninterrupted

import tiered

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    ("param", "opt"), [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")]
)
def test_resume_on_cuda_is_bit_exact(tmp_path: Path, param: str, opt: str) -> None:
    config = ds_config(
        param=param, opt=opt, nvme_path=str(tmp_path / "nvme"), dtype="bf16", scheduler=SCHEDULER
    )
    _resume_equals_uninterrupted(tmp_path, "llama", config, n=2, m=2, device="cuda")


def test_save_pretrained_on_cuda_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    case = CASES["llama"]
    with tiered.initialize(build(case), ds_config(dtype="bf16")) as e:
        for b in make_batches(case, 2, 4):
            loss = case.loss(e(**{k: v.cuda() for k, v in b.items()}))
            e.backward(loss)
            e.step()
        want = e.state_dict_fp32()
        e.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16)
    for k, v in loaded.named_parameters():
        assert torch.equal(v.detach(), want[k].cpu().to(torch.bfloat16)), k
