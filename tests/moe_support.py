"""Tiny model folders of the MoE and wrapped families, written as transformers 5 writes them
(``save_pretrained``: sharded, with an index; per-expert tensors where the family's files have
them), and the plain-PyTorch reference that training them through tiered must equal."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**_COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    )


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_COMMON,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
    )


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4},
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )


def _deepseek_v2() -> Any:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **{**_COMMON, "num_key_value_heads": 4},
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )


def _olmoe() -> Any:
    from transformers import OlmoeConfig

    return OlmoeConfig(
        **_COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0
    )


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=8
    )


def _gemma3() -> Any:
    from transformers import Gemma3Config

    text = dict(
        vocab_size=VOCAB + 8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=64,
        sliding_window=16,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    return Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB + 7
    )


FAMILIES: dict[str, Callable[[], Any]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "gemma3": _gemma3,
}
"""Family -> its tiny transformers config (2 layers, hidden 32, 4 experts of which 2 per token)."""
PER_EXPERT = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "olmoe"}
"""Families whose files hold one tensor per expert (gpt-oss's hold them fused)."""
ATTENTION_TARGETS = {
    "deepseek_v3": ("q_b_proj", "kv_b_proj"),
    "deepseek_v2": ("q_proj", "kv_b_proj"),
}
"""LoRA targets in the attention of each family (default: q_proj, v_proj)."""


def hf_config(family: str, vocab: int | None = None) -> Any:
    """`family`'s tiny config; `vocab`: another vocabulary (256 for the command line's byte tokenizer)."""
    cfg = FAMILIES[family]()
    if vocab is not None:
        text = cfg.get_text_config()
        text.vocab_size = vocab
        if family == "gemma3":
            cfg.image_token_index = vocab - 1
    return cfg


def write_folder(
    folder: Path,
    family: str,
    *,
    seed: int = 0,
    shard: str = "24KB",
    vocab: int | None = None,
    config: Any = None,
) -> Path:
    """`family`'s tiny model (or `config`'s), initialised by transformers from `seed`, saved by its
    own ``save_pretrained`` into `folder` in shards of `shard` (so with an index)."""
    from transformers import AutoModelForCausalLM

    from tiered.planning.text_model import causal_lm_class

    torch.manual_seed(seed)
    cfg = config if config is not None else hf_config(family, vocab)
    model = causal_lm_class(cfg, family)._from_config(cfg, dtype=torch.float32)
    assert config is not None or type(model) is type(AutoModelForCausalLM.from_config(cfg))
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def file_keys(folder: Path) -> dict[str, str]:
    """The tensors of a saved folder, by the index: key -> shard file."""
    return dict(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


def reference(folder: Path) -> Any:
    """The folder loaded by transformers (fp32, eager attention), its other towers frozen as
    tiered freezes them ([Note: wrapped models train their language model])."""
    from transformers import AutoModelForCausalLM

    from tiered.planning.text_model import freeze_other_towers

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    freeze_other_towers(model)
    return model.train()


def batches(n: int, *, seed: int = 5, vocab: int = VOCAB) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def torch_adamw(model: Any, data: list[dict[str, torch.Tensor]], *, lr: float = 1e-2) -> list[float]:
    """Plain PyTorch AdamW over the trainable parameters (the ground truth); the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    losses = []
    for b in data:
        loss = model(**b).loss
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def tiered_steps(engine: Any, data: list[dict[str, torch.Tensor]]) -> list[float]:
    losses = []
    for b in data:
        loss = engine(**b).loss
        losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
    return losses


def config(
    tmp_path: Path, *, param: str = "cpu", opt: str = "cpu", lr: float = 1e-2, **kw: Any
) -> dict[str, Any]:
    from engine_support import ds_config

    kw.setdefault("sub_group_size", 4000)
    return ds_config(param=param, opt=opt, nvme_path=str(tmp_path / "nvme"), lr=lr, **kw)


def clone(model: Any) -> Any:
    return copy.deepcopy(model)


def saved_keys(folder: Path) -> set[str]:
    """The tensor names in a folder's safetensors files."""
    from safetensors import safe_open

    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys.update(h.keys())
    return keys
