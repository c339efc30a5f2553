"""The zoo: real ds_config files from public projects (tests/data/ds_configs, sources and the
expected outcome of each in index.json). Each one, with the hyper-parameters a Trainer would pass
(only where the file leaves them "auto" or out, as a TrainingArguments that agrees with the file),
either trains one step on a tiny Llama or is refused with an error naming a feature tiered does
not support."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tiered
from tiered.config import keys as config_keys
from tiered.config.values import is_auto
from tiered.errors import TieredError, UnsupportedConfigError

ZOO = Path(__file__).parent / "data" / "ds_configs"
INDEX: dict[str, dict[str, Any]] = json.loads((ZOO / "index.json").read_text(encoding="utf-8"))

# What HF's TrainingArguments would hold (its defaults, except a small batch and 1 step).
_TRAINER = {
    "lr": 5e-5,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "warmup_steps": 0,
    "total_steps": 1,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "max_grad_norm": 1.0,
}
_KEY_OF = {
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "warmup_steps": "scheduler.params.warmup_num_steps",
    "total_steps": "scheduler.params.total_num_steps",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "gradient_clipping",
}


def _get(config: dict[str, Any], path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _explicit(config: dict[str, Any], path: str) -> bool:
    value = _get(config, path)
    return value is not None and not is_auto(value)


def trainer_keywords(config: dict[str, Any]) -> dict[str, Any]:
    """The keywords a Trainer whose arguments agree with `config` passes to tiered.initialize."""
    kw = {k: v for k, v in _TRAINER.items() if not _explicit(config, _KEY_OF[k])}
    if "lr" in kw and _explicit(config, "scheduler.params.warmup_max_lr"):
        # HF matches warmup_max_lr against learning_rate: the trainer's lr is that one
        kw["lr"] = float(_get(config, "scheduler.params.warmup_max_lr"))
    if _explicit(config, "train_batch_size"):
        kw.pop("micro_batch_size", None)  # the file fixes the batch; the trainer's agrees with it
    if _explicit(config, "fp16.enabled") and _get(config, "fp16.enabled") is True:
        kw["mixed_precision"] = "fp16"
    elif any(_get(config, f"{k}.enabled") is True for k in ("bf16", "bfloat16")):
        kw["mixed_precision"] = "bf16"
    else:
        kw["mixed_precision"] = "no"
    return kw


def _with_tmp_nvme(config: dict[str, Any], nvme: Path) -> dict[str, Any]:
    for key in ("offload_param", "offload_optimizer"):
        section = _get(config, f"zero_optimization.{key}")
        if isinstance(section, dict) and section.get("device") == "nvme":
            section["nvme_path"] = str(nvme)  # the file's drive does not exist here
    return config


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    """One Llama block, hidden 16 (built once; each test trains a deep copy): the zoo is about
    configs, and 37 of them must run in seconds."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_the_zoo_is_big_and_indexed() -> None:
    files = sorted(p.name for p in ZOO.glob("*.json") if p.name != "index.json")
    assert files == sorted(INDEX), "every zoo file has an index entry and every entry a file"
    assert len(files) >= 30
    for name, entry in INDEX.items():
        assert {"repo", "path", "commit", "licence", "expect"} <= set(entry), name
        assert entry["expect"] in ("trains", "refused"), name
        if entry["expect"] == "refused":
            assert entry["error"] and entry["feature"], name


@pytest.mark.parametrize("name", sorted(INDEX))
def test_zoo_config(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, tiny_llama: torch.nn.Module
) -> None:
    entry = INDEX[name]
    config = _with_tmp_nvme(json.loads((ZOO / name).read_text(encoding="utf-8")), tmp_path / "nvme")
    kw = trainer_keywords(config)
    model = copy.deepcopy(tiny_llama)
    config_keys._warned.clear()
    if entry["expect"] == "refused":
        with pytest.raises(UnsupportedConfigError) as info:
            tiered.initialize(model, config, **kw)
        message = str(info.value)
        assert entry["error"] in message, message
        assert "not supported" in message or "does not support" in message, message
        return
    with caplog.at_level(logging.WARNING, logger="tiered"):
        try:
            engine = tiered.initialize(model, config, **kw)
        except TieredError as exc:  # pragma: no cover - the message is the point of the failure
            pytest.fail(f"{name} should train but was refused: {exc}")
    with engine:
        c = engine.config
        assert c.unset == ()
        assert c.optimizer.lr == (kw["lr"] if "lr" in kw else float(_get(config, "optimizer.params.lr")))
        first_lr = float(engine.scheduler.lr_at(0))  # a log warmup starts at 0, as in DeepSpeed
        micro = c.train_micro_batch_size_per_gpu or 2
        g = torch.Generator().manual_seed(0)
        before = {k: v.clone() for k, v in engine.state_dict_fp32().items()}
        losses = []
        for _ in range(c.gradient_accumulation_steps):
            ids = torch.randint(0, 64, (micro, 8), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        assert engine.global_steps == 1 and all(torch.isfinite(torch.tensor(losses)))
        after = engine.state_dict_fp32()
        if engine.skipped_steps == 0 and first_lr > 0:  # an fp16 first step may overflow and skip
            assert any(not torch.equal(before[k], after[k]) for k in before), "one step changed nothing"
    for warned in entry.get("warns", []):
        assert f"'{warned}'" in caplog.text, (warned, caplog.text)
