"""Training through tiered on a CUDA GPU equals plain PyTorch there (run by benchmarks/gpu_check).

The "gpu" tier is then real device memory: gathers are host-to-device copies on the side stream,
gradients leave the device as they complete, and with offload_optimizer none the CUDA Adam kernel
steps the groups in device memory.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import (
    CASES,
    REL,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    make_batches,
    reference_train,
    tiered_train,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _on(batches: list[dict[str, torch.Tensor]], device: str) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


@pytest.mark.parametrize(
    ("param", "opt"), [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("none", "cpu")]
)
def test_llama_on_cuda_equals_plain_torch(tmp_path: Any, param: str, opt: str) -> None:
    case = CASES["llama"]
    batches = _on(make_batches(case, 3, 4), "cuda")
    want_losses, want = reference_train(build(case).cuda(), case, batches)
    got_losses, got, stats = tiered_train(
        build(case), case, batches, ds_config(param=param, opt=opt, nvme_path=str(tmp_path / "nvme"))
    )
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, {k: v.cpu() for k, v in want.items()}, REL)
    assert stats["tiers"]["tiers"]["gpu"]["peak_bytes"] > 0
