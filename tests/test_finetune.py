"""`tiered finetune` and the fine-tuning demo: training through the engine with NVMe offload equals
plain PyTorch AdamW; the command line's output, stats JSON, exit codes and Ctrl-C."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import REL

import tiered
from tiered.cli.main import main
from tiered.config import apply_overrides, load_config
from tiered.errors import ConfigError, TieredError
from tiered.finetune import (
    TrainOptions,
    batches,
    build_model,
    max_rel_diff,
    reference_train,
    resolve_model,
    train,
)

TINY = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
TEXT = (
    "The fast place is small. The large place is slow. The work happens in the fast place; "
    "the art is in the carrying. "
) * 8


def ds_config(nvme: Path, *, gas: int = 1, clip: float = 0.0, warmup: int = 0) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
            "sub_group_size": 4000,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if warmup:
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 3e-3,
                "warmup_num_steps": warmup,
                "warmup_type": "linear",
            },
        }
    return cfg


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    cfg = tmp_path / "ds_config.json"
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


# ---- equivalence with plain PyTorch ---------------------------------------------------------------
@pytest.mark.parametrize(("gas", "clip", "warmup"), [(1, 0.0, 0), (2, 0.05, 0), (1, 0.0, 3)])
def test_train_equals_plain_pytorch_adamw_with_nvme_offload(
    files: dict[str, Path], gas: int, clip: float, warmup: int
) -> None:
    src = resolve_model(files["model"])
    ids = torch.tensor(list(TEXT.encode()))
    model, ref_model = build_model(src, seed=3), build_model(src, seed=3)
    raw = ds_config(files["tmp"] / "nvme", gas=gas, clip=clip, warmup=warmup)
    raw["tiered"] = {"residency": "off"}  # through the nvme tier each step, not kept in cpu memory
    cfg = load_config(raw, model=model)
    lrs: list[float] = []
    result = train(
        model,
        cfg,
        batches(ids, 16, 2, seed=7),
        TrainOptions(steps=3, keep_state=True, on_log=lambda s: lrs.append(s.lr)),
    )
    want_losses, want = reference_train(ref_model, cfg, batches(ids, 16, 2, seed=7), 3)
    assert result.steps_done == 3 and not result.interrupted
    assert result.tokens == 3 * gas * 2 * 16
    assert all(math.isfinite(x) for x in result.losses)
    for got_l, want_l in zip(result.losses, want_losses, strict=True):
        assert math.isclose(got_l, want_l, rel_tol=REL), (result.losses, want_losses)
    diff, name = max_rel_diff(result.state or {}, want)
    assert diff <= REL, f"{name} differs by {diff:.3g}"
    # the parameters really moved (a no-op step would also "match" a no-op reference)
    init = dict(build_model(src, seed=3).named_parameters())
    assert max_rel_diff(init, want)[0] > 1e-3
    # offloaded for real: the optimizer state and params went through the nvme tier
    links = result.stats["tiers"]["links"]
    assert any(k.startswith("nvme->") for k in links) and any(k.endswith("->nvme") for k in links)
    assert result.stats["global_steps"] == 3
    if clip:
        assert result.stats["last_grad_norm"] > clip  # the clip was active, and matched
    if warmup:  # DeepSpeed's WarmupLR: min at step 0, linear i / W after
        assert lrs == pytest.approx([0.0, 0.0, 1e-3])


def test_finetune_job_compare_reports_match(files: dict[str, Path]) -> None:
    from tiered.cli.finetune import finetune_job
    from tiered.cli.finetune.options import FinetuneOptions

    out = io.StringIO()
    job = finetune_job(
        FinetuneOptions(
            model_path=files["model"],
            config=files["config"],
            data_path=files["data"],
            seq_len=16,
            steps=3,
            compare_torch=True,
        ),
        out,
    )
    assert job.max_rel_diff is not None and job.max_rel_diff <= REL
    assert job.reference_losses is not None
    assert math.isclose(job.result.losses[-1], job.reference_losses[-1], rel_tol=REL)
    text = out.getvalue()
    assert "plain PyTorch" in text and "max relative parameter difference" in text


# ---- the command line ---------------------------------------------------------------------------
def test_cli_prints_progress_stats_and_writes_json(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    stats = files["tmp"] / "stats.json"
    assert (
        main(cli(files, "--log-every", "2", "--lr", "1e-3", "--batch-size", "3", "--stats-json", str(stats)))
        == 0
    )
    out = capsys.readouterr().out
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["2/3", "3/3"]  # every 2nd step and the last
    assert "lr 0.001" in steps[0] and "tokens/s" in steps[0]
    assert "micro-batch 3" in out
    for word in ("peak resident", "bytes moved", "GB/s", "stall", "nvme->"):
        assert word in out, word
    doc = json.loads(stats.read_text())
    assert doc["steps_done"] == 3 and len(doc["losses"]) == 3 and doc["interrupted"] is False
    assert doc["tokens"] == 3 * 3 * 16 and doc["tokens_per_s"] > 0
    assert set(doc["engine"]["tiers"]["tiers"]) >= {"gpu", "cpu", "nvme"}
    assert doc["engine"]["tiers"]["links"]["nvme->gpu"]["bytes"] > 0
    assert doc["args"]["lr"] == 1e-3


def test_cli_via_python_m(files: dict[str, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tiered.cli.main", *cli(files, "--steps", "1")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", **_env()},
    )
    assert proc.returncode == 0, proc.stderr
    assert "step     1/1  loss" in proc.stdout and "peak resident" in proc.stdout


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


@pytest.mark.parametrize("which", ["model", "data", "config"])
def test_cli_missing_path_is_one_line_exit_2(
    files: dict[str, Path], which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    files = dict(files)
    files[which] = files["tmp"] / f"missing-{which}"
    assert main(cli(files)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--{which} " in err and f"missing-{which}" in err and "no such file" in err


def test_cli_small_vocab_with_byte_tokenizer(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (files["model"] / "config.json").write_text(json.dumps({**TINY, "vocab_size": 100}))
    assert main(cli(files)) == 2
    err = capsys.readouterr().err
    assert "byte tokenizer needs vocab_size >= 256" in err and "vocab_size is 100" in err


def test_cli_compare_torch_refuses_bf16_before_training(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    files["config"].write_text(json.dumps({**ds_config(files["tmp"] / "nvme"), "bf16": {"enabled": True}}))
    assert main(cli(files, "--compare-torch")) == 2
    captured = capsys.readouterr()
    assert "--compare-torch compares fp32 runs only" in captured.err and "step " not in captured.out


def test_cli_seq_len_beyond_positions(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(cli(files, "--seq-len", "65")) == 2
    assert "--seq-len 65 exceeds the model's max_position_embeddings 64" in capsys.readouterr().err


def test_cli_stats_json_in_missing_folder(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(cli(files, "--stats-json", str(files["tmp"] / "no" / "s.json"))) == 2
    assert "--stats-json" in capsys.readouterr().err


def test_run_directly_raises_tiered_error(files: dict[str, Path]) -> None:
    import argparse

    from tiered.cli import finetune

    parser = argparse.ArgumentParser()
    finetune.add_parser(parser.add_subparsers())
    args = parser.parse_args(cli({**files, "data": files["tmp"] / "gone.txt"}))
    with pytest.raises(ConfigError, match=r"--data .*gone\.txt: no such file"):
        finetune.run(args, io.StringIO())


def test_train_takes_one_options_value_and_the_old_keywords() -> None:
    """train() had 13 parameters; what a run is told is now one TrainOptions (the keywords
    callers wrote before still work: tests below pass on_log= and keep_state= that way)."""
    import dataclasses
    import inspect

    named = [p for p in inspect.signature(train).parameters.values() if p.kind != p.VAR_KEYWORD]
    assert [p.name for p in named] == ["model", "config", "stream", "opts"]
    opts = TrainOptions(steps=2, keep_state=True)
    assert dataclasses.replace(opts, log_every=2) == TrainOptions(steps=2, log_every=2, keep_state=True)
    with pytest.raises(ConfigError, match="--eval-every must be >= 1"):
        TrainOptions(steps=2, eval_data=lambda: [], eval_every=0)
    with pytest.raises(TypeError, match="no_such"):
        train(None, {}, iter(()), opts, no_such=1)  # type: ignore[arg-type]


def test_apply_overrides() -> None:
    import tiered.finetune

    assert tiered.finetune.apply_overrides is apply_overrides  # the old import path still works
    base = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": "/a"},
            "offload_optimizer": {"device": "cpu"},
        },
    }
    got = apply_overrides(base, lr=0.5, batch_size=3, nvme_path="/b")
    assert got["optimizer"]["params"]["lr"] == 0.5
    assert (got["train_micro_batch_size_per_gpu"], got["train_batch_size"]) == (3, 6)
    assert got["zero_optimization"]["offload_param"]["nvme_path"] == "/b"
    assert "nvme_path" not in got["zero_optimization"]["offload_optimizer"]
    assert base["train_micro_batch_size_per_gpu"] == 4  # the input is not modified
    with pytest.raises(ConfigError, match="--lr must be > 0"):
        apply_overrides(base, lr=0.0)


# ---- Ctrl-C -------------------------------------------------------------------------------------
def test_ctrl_c_closes_the_engine_and_keeps_the_steps_done(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engines: list[Any] = []
    real = tiered.initialize

    def spy(*a: Any, **k: Any) -> Any:
        engines.append(real(*a, **k))
        return engines[-1]

    monkeypatch.setattr(tiered, "initialize", spy)
    src = resolve_model(files["model"])
    model = build_model(src)
    cfg = load_config(ds_config(files["tmp"] / "nvme"), model=model)

    def on_log(s: Any) -> None:
        if s.step == 2:
            raise KeyboardInterrupt

    result = train(
        model, cfg, batches(torch.tensor(list(TEXT.encode())), 16, 2, 0), TrainOptions(steps=5), on_log=on_log
    )
    assert result.interrupted and result.steps_done == 2 and len(result.losses) == 2
    assert result.stats["global_steps"] == 2
    with pytest.raises(RuntimeError, match="closed"):
        engines[0].step()


def test_cli_ctrl_c_exits_130_and_writes_partial_stats(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tiered.finetune as ft

    real = ft.PackedBatches

    def interrupted_stream(*a: Any, **k: Any) -> Any:
        for i, b in enumerate(real(*a, **k)):
            if i == 2:
                raise KeyboardInterrupt
            yield b

    monkeypatch.setattr(ft, "PackedBatches", interrupted_stream)
    stats = files["tmp"] / "s.json"
    assert main(cli(files, "--steps", "5", "--stats-json", str(stats))) == 130
    out = capsys.readouterr().out
    assert "interrupted after 2 of 5 steps; engine closed" in out
    doc = json.loads(stats.read_text())
    assert doc["interrupted"] is True and doc["steps_done"] == 2


# ---- the demo -------------------------------------------------------------------------------------
def test_examples_are_reachable_and_tiny_llama_is_small() -> None:
    from tiered.cli.demo_finetune import examples_dir

    ex = examples_dir()
    model = build_model(resolve_model(ex / "tiny-llama"))
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 5_000_000
    raw = json.loads((ex / "ds_config.json").read_text())
    assert raw["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert raw["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert len((ex / "corpus.txt").read_bytes()) > 2000


def test_examples_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered.cli import demo_finetune

    fake_pkg = tmp_path / "site" / "tiered"
    fake_pkg.mkdir(parents=True)
    monkeypatch.setattr(tiered, "__file__", str(fake_pkg / "__init__.py"))
    with pytest.raises(TieredError, match=r"example files are missing: .*tiny-llama.*pip install -e \."):
        demo_finetune.examples_dir()


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_demo_quick_trains_matches_and_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered.cli import demo_finetune

    monkeypatch.setattr(demo_finetune, "QUICK_STEPS", 3)
    monkeypatch.setattr(demo_finetune, "SEQ_LEN", 32)
    out = io.StringIO()
    assert demo_finetune.run_demo(True, tmp_path, out) == 0
    text = out.getvalue()
    assert "loss went down" in text and "tiered matches plain PyTorch AdamW" in text
    assert "final loss: tiered" in text and "peak resident" in text
    # the 40B verdict is `tiered plan`'s: the search's placements, its fastest config and its s/step
    assert "no placement without offload fits; the fastest config that does:" in text
    assert "recommended: optimizer nvme" in text and "predicted" in text and "s/step" in text
    assert '"zero_optimization"' in text  # the config to launch with
    assert list(tmp_path.iterdir()) == []  # the temporary NVMe folder is gone
