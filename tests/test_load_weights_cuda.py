"""Streaming load on a CUDA GPU: shards go through pinned shard buffers to the device tier
([Note: streaming load]); run by benchmarks/gpu_check with the other cuda-marked tests."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(("param", "dtype"), [("none", "bf16"), ("cpu", "fp32"), ("nvme", "bf16")])
def test_streamed_weights_reach_the_device(tmp_path, param, dtype):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    import tiered
    from tests.engine_support import ds_config
    from tiered.testing.weights import write_random_weights

    hf = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    folder = tmp_path / "model"
    write_random_weights(folder, hf, shard_bytes=8 << 10)
    want: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        want.update(load_file(str(f)))
    cfg = ds_config(param=param, opt="cpu", nvme_path=str(tmp_path / "nvme"), dtype=dtype)
    with tiered.from_pretrained(folder, cfg) as engine:
        sd = engine.zero.gather_full_state_dict()
        for k, v in want.items():
            torch.testing.assert_close(sd[k].float().cpu(), v.float(), rtol=0, atol=0, msg=k)
        ids = torch.randint(0, 64, (2, 12), device="cuda")
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
