"""`tiered finetune` with the new data options: formats end to end, the eval split and eval
loss, the activation check, and bad input refused before training with nothing left behind."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from finetune_support import ds_config, write_jsonl, write_model

from tiered.cli.main import main
from tiered.errors import CapacityError
from tiered.finetune import build_model, eval_loss, resolve_model
from tiered.finetune.activations import estimate_activations

CHAT = {
    "messages": [
        {"role": "user", "content": "what is fast?"},
        {"role": "assistant", "content": "the small place is fast."},
    ]
}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model = write_model(tmp_path / "model")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"the fast place {i} is small."} for i in range(30)])
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(tmp_path / "nvme")))
    return {"model": model, "data": data, "config": cfg, "tmp": tmp_path}


def cli(files: dict[str, Path], *extra: str) -> list[str]:
    return [
        "finetune",
        "--model",
        str(files["model"]),
        "--config",
        str(files["config"]),
        "--data",
        str(files["data"]),
        "--seq-len",
        "16",
        "--steps",
        "3",
        *extra,
    ]


def test_jsonl_with_eval_split_prints_and_records_eval_loss(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    stats = files["tmp"] / "s.json"
    assert main(cli(files, "--eval-fraction", "0.2", "--eval-every", "2", "--stats-json", str(stats))) == 0
    out = capsys.readouterr().out
    assert "30 documents" in out and "EOS id 256" in out and "eval rows" in out
    evals = [ln for ln in out.splitlines() if ln.startswith("eval ")]
    assert [ln.split()[1] for ln in evals] == ["2/3", "3/3"]
    doc = json.loads(stats.read_text())
    assert [e["step"] for e in doc["eval_losses"]] == [2, 3]
    assert all(math.isfinite(e["loss"]) for e in doc["eval_losses"])
    assert doc["args"]["eval_fraction"] == 0.2


def test_chat_data_trains_through_the_cli(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    files["data"] = write_jsonl(files["tmp"] / "chat.jsonl", [CHAT] * 12)
    assert main(cli(files, "--eval-data", str(files["data"]))) == 0
    out = capsys.readouterr().out
    assert "12 documents" in out and "% of labels trained" in out
    assert "0% of labels trained" not in out and "100% of labels trained" not in out
    assert len([ln for ln in out.splitlines() if ln.startswith("eval ")]) == 1  # after the last step


def test_eval_loss_weights_by_trained_tokens(tmp_path: Path) -> None:
    model = build_model(resolve_model(write_model(tmp_path / "m", tokenizer=False)), seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 8), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100  # row 0 trains 2 tokens (after the shift), rows 1 and 2 train 7
    batches = [{"input_ids": ids[:1], "labels": labels[:1]}, {"input_ids": ids[1:], "labels": labels[1:]}]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
        want = float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        )
    assert model.training
    assert math.isclose(eval_loss(model, model, batches), want, rel_tol=1e-6)
    assert model.training  # restored


# ---- the activation check ------------------------------------------------------------------------
def test_activation_estimate_is_the_megatron_formula() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=100, intermediate_size=128
    )
    e = estimate_activations(
        cfg, batch=2, seq_len=32, dtype=torch.bfloat16, checkpointing=False, compute_on_cpu=False
    )
    per_layer = 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)  # s b h (34 + 5 a s / h), 16-bit bytes
    assert e.per_layer_bytes == int(per_layer)
    assert e.total_bytes == 3 * int(per_layer) + 2 * 2 * 32 * 100 * 4
    f = estimate_activations(
        cfg, batch=2, seq_len=32, dtype=torch.float32, checkpointing=False, compute_on_cpu=False
    )
    assert f.per_layer_bytes == 2 * e.per_layer_bytes
    c = estimate_activations(
        cfg, batch=2, seq_len=32, dtype=torch.bfloat16, checkpointing=True, compute_on_cpu=False
    )
    assert c.total_bytes == 3 * 32 * 2 * 64 * 2 + e.per_layer_bytes + e.logits_bytes < e.total_bytes


def test_a_cpu_moe_estimate_holds_a_kernel_per_expert_token_count() -> None:
    """[Note: per-shape kernels of a CPU MoE]: each token count an expert can get (1..batch x seq)
    is a new oneDNN kernel set where a 16-bit MoE computes on the CPU; none for a dense model,
    in fp32 or on a GPU; beyond the primitive cache a count costs less."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig

    from tiered.finetune.activations import (
        CPU_CACHED_COUNTS,
        CPU_EXPERT_COUNT_BYTES,
        CPU_UNCACHED_COUNT_BYTES,
    )

    small = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100, intermediate_size=128
    )
    moe = MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)

    def est(cfg: object, *, seq: int = 32, dtype: torch.dtype = torch.bfloat16, cpu: bool = True) -> object:
        return estimate_activations(
            cfg, batch=2, seq_len=seq, dtype=dtype, checkpointing=False, compute_on_cpu=cpu
        )

    on_cpu = est(moe)
    assert on_cpu.routed_experts == 4
    assert on_cpu.expert_kernels_bytes == 64 * CPU_EXPERT_COUNT_BYTES
    assert on_cpu.total_bytes == est(moe, cpu=False).total_bytes + 64 * CPU_EXPERT_COUNT_BYTES
    assert "per-shape CPU kernels 256.00 MiB" in on_cpu.describe()
    assert est(moe, cpu=False).expert_kernels_bytes == 0  # a GPU's compute: not host memory
    assert est(moe, dtype=torch.float32).expert_kernels_bytes == 0  # fp32 builds no per-shape kernels
    assert est(LlamaConfig(**small)).expert_kernels_bytes == 0  # dense: its few shapes are in the baseline
    long = est(moe, seq=1000)  # 2000 counts: the cache holds CPU_CACHED_COUNTS of them
    assert long.expert_kernels_bytes == (
        CPU_CACHED_COUNTS * CPU_EXPERT_COUNT_BYTES + (2000 - CPU_CACHED_COUNTS) * CPU_UNCACHED_COUNT_BYTES
    )
    qwen = Qwen2MoeConfig(**small, num_experts=8, num_experts_per_tok=2)  # another family's key
    assert est(qwen).expert_kernels_bytes == 64 * CPU_EXPERT_COUNT_BYTES


def test_auto_config_leaves_the_estimated_activations_their_room(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """--auto-config fits a config around the run's own activations ([Note: activation estimate]
    for --batch-size x --seq-len): a batch whose activations leave too little of --auto-config's
    memory is refused naming them, the same memory with a small batch trains."""
    auto = ["--auto-config", "cpu_mem=700MiB,gpu_mem=1GiB", "--steps", "1"]
    assert main(cli(files, "--batch-size", "2048", *auto)) == 2  # ~251 MiB of activations
    err = capsys.readouterr().err
    assert "nothing fits the memory given (--auto-config cpu_mem 700.00 MiB" in err  # as the user gave it
    assert "the activations take 251.00 MiB of the memory given" in err and "--batch-size" in err
    with caplog.at_level("INFO"):
        assert main(cli(files, "--batch-size", "2", *auto)) == 0
    assert "activation_mem from the estimate: ~251.00 KiB" in caplog.text
    assert "tiered.auto_config chose" in caplog.text


def test_auto_config_memory_beyond_the_machine_names_the_flag(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--auto-config cpu_mem above this machine's memory was refused naming tiered.tiers.cpu.budget,
    a key the user never wrote; now it names the flag as given, before any folder is left behind."""
    assert main(cli(files, "--auto-config", "cpu_mem=1PB", "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert "--auto-config cpu_mem 909.49 TiB is more than this machine's host memory has in all" in err
    assert "tiered.tiers" not in err and "Traceback" not in err
    assert not (files["tmp"] / "nvme").exists()


def test_huge_batch_is_refused_before_training_leaving_nothing(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # ~75 TB of activations (2 layers, fp32): no machine has that much memory free
    assert main(cli(files, "--batch-size", "100000000", "--seq-len", "64")) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "--batch-size 100000000 x --seq-len 64" in err and "activations" in err and "exceed the" in err
    assert "lower --batch-size or --seq-len, or add --gradient-checkpointing" in err
    assert "step " not in captured.out
    assert not (files["tmp"] / "nvme").exists()


def test_activation_check_uses_the_free_memory(files: dict[str, Path], tmp_path: Path) -> None:
    import io

    from tiered.cli.finetune import finetune_job
    from tiered.cli.finetune.options import FinetuneOptions

    kw: dict[str, Any] = {
        "model_path": files["model"],
        "config": files["config"],
        "data_path": files["data"],
        "seq_len": 16,
        "steps": 1,
    }
    with pytest.raises(CapacityError, match=r"exceed the test memory, 1000 B"):
        finetune_job(FinetuneOptions(**kw, free_memory=(1000, "test memory")), io.StringIO())
    assert not (files["tmp"] / "nvme").exists()
    job = finetune_job(FinetuneOptions(**kw, free_memory=(10**12, "test memory")), io.StringIO())
    assert job.result.steps_done == 1


# ---- bad input through the CLI: before training, nothing left behind --------------------------------
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", r"d\.jsonl: the file is empty"),
        ('{"text": "a"}\n{"txt": "b"}\n', r"d\.jsonl:2: row has no 'text' field"),
        ('{"text": "a"}\n{oops\n', r"d\.jsonl:2: malformed JSON"),
        (
            '{"messages": [{"role": "wizard", "content": "x"}]}\n',
            r"d\.jsonl:1: message 0 has unknown role 'wizard'",
        ),
    ],
)
def test_bad_data_is_one_line_before_training(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    files["data"].write_text(content)
    assert main(cli(files)) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1
    assert __import__("re").search(message, captured.err), captured.err
    assert "step " not in captured.out and not (files["tmp"] / "nvme").exists()


def test_empty_data_folder_and_eval_every_without_eval(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (files["tmp"] / "empty").mkdir()
    assert main(cli({**files, "data": files["tmp"] / "empty"})) == 2
    assert "the folder has no usable files" in capsys.readouterr().err
    assert main(cli(files, "--eval-every", "2")) == 2
    assert "--eval-every needs --eval-fraction or --eval-data" in capsys.readouterr().err
    assert not (files["tmp"] / "nvme").exists()


def test_torchrun_world_size_is_refused_not_replicated(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(cli(files)) == 2
    captured = capsys.readouterr()
    assert "WORLD_SIZE=2 in the environment" in captured.err and "step " not in captured.out
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(cli(files, "--steps", "1")) == 0
