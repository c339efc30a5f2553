"""One run of tests/test_memory_promise.py in a process of its own (ru_maxrss is the process's):
a 136M Llama, parameters and Adam state homed on NVMe, 3 steps of 1 x 128 tokens; prints the
engine's promised host peak, the activation estimate and the peak RSS as JSON."""

from __future__ import annotations

import json
import resource
import sys
import tempfile

import torch
import transformers

import tiered
from tiered.finetune.activations import estimate_activations

SEQ = 128


def main(dtype: str, residency: str, cpu_mem: str | None) -> None:
    hf = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    act = estimate_activations(
        hf, batch=1, seq_len=SEQ, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
        checkpointing=False, compute_on_cpu=True,
    ).total_bytes  # fmt: skip
    nvme = tempfile.mkdtemp()
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
        "tiered": {"residency": residency},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if cpu_mem is not None:  # the plan's own config for that much host memory
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": cfg["optimizer"],
            **({"bf16": cfg["bf16"]} if dtype == "bf16" else {}),
        }
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {"nvme_path": nvme},
            "offload_param": {"nvme_path": nvme},
        }
        cfg["tiered"] = {"auto_config": {"cpu_mem": cpu_mem, "nvme_mem": "100GB", "activation_mem": act}}
    x = torch.randint(0, 32000, (1, SEQ))
    with tiered.initialize(model, cfg) as engine:
        for _ in range(3):
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
        host = engine.stats()["host_memory"]
        placement = engine.stats()["capacity"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"planned": host["planned_peak_bytes"], "activations": act, "rss": rss,
                      "tiers": sorted(placement)}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
