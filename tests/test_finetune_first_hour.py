"""What a new user meets in the first hour of `tiered finetune` and `tiered demo`: output paths
inside --out, refusals that fit the interface, the export's dtype, an --out that holds another
run, what the demo says it keeps, the peft load line, the tier table without a GPU, and
finetune_job leaving its options alone."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from finetune_support import ds_config, write_model

import tiered
from tiered.cli.main import main
from tiered.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _job(tmp_path: Path, **cfg_extra: Any) -> list[str]:
    model = write_model(tmp_path / "m")
    data = tmp_path / "d.txt"
    data.write_text("the fast place is small, the slow place is big. " * 20)
    cfg = {**ds_config(tmp_path / "nvme", param="nvme", opt="cpu"), **cfg_extra}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    return ["finetune", "--model", str(model), "--config", str(tmp_path / "ds.json"), "--data", str(data),
            "--seq-len", "16", "--steps", "1"]  # fmt: skip


def test_outputs_inside_out_are_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"  # does not exist yet: --out creates it
    extra = ["--out", str(run), "--trace", str(run / "trace.json"), "--plot", str(run / "plot.png")]
    assert main([*_job(tmp_path), *extra, "--stats-json", str(run / "stats" / "s.json")]) == 0, (
        capsys.readouterr()
    )
    for name in ("trace.json", "plot.png", "stats/s.json", "final/config.json"):
        assert (run / name).is_file(), name
    # examples/README.md: the offload files go into a private folder under nvme_path, removed at the end
    assert (tmp_path / "nvme").is_dir() and list((tmp_path / "nvme").iterdir()) == []
    readme = (ROOT / "examples" / "README.md").read_text()
    assert "removed\n  when the run ends" in readme and "they stay there" not in readme
    # outside --out, a missing folder is still refused before anything runs
    assert main([*_job(tmp_path), "--trace", str(tmp_path / "nope" / "t.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_auto_refusals_fit_the_interface(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path)
    cfg = json.loads((tmp_path / "ds.json").read_text())
    cfg["optimizer"]["params"]["betas"] = "auto"
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    assert main(job) == 2
    err = capsys.readouterr().err
    assert "optimizer.params.betas" in err and "tiered finetune has no flag for it" in err
    assert "write a value there (e.g. [0.9, 0.999])" in err
    assert "tiered.initialize" not in err and "betas=" not in err
    cfg["optimizer"]["params"] = {"lr": "auto"}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    assert main(job) == 2
    err = capsys.readouterr().err
    assert "optimizer.params.lr" in err and "pass --lr" in err and "tiered.initialize" not in err
    # the Python API names its own keyword
    with pytest.raises(ConfigError, match=r"pass betas= to tiered\.initialize"):
        tiered.initialize(
            torch.nn.Linear(4, 4),
            {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto"}}},
        )


def test_bf16_export_config_carries_its_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    assert main([*_job(tmp_path, bf16={"enabled": True}), "--out", str(run)]) == 0, capsys.readouterr()
    doc = json.loads((run / "final" / "config.json").read_text())
    assert doc.get("dtype", doc.get("torch_dtype")) == "bfloat16", doc
    loaded = AutoModelForCausalLM.from_pretrained(str(run / "final"), dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_an_out_holding_another_run_is_refused_unless_resume_or_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job, run = _job(tmp_path), tmp_path / "run"
    # a save lock and an interrupted save's leftover are not another run's checkpoints
    (run / "checkpoints" / ".global_step1.partial").mkdir(parents=True)
    (run / "checkpoints" / ".lock").write_text("")
    assert main([*job, "--out", str(run), "--save-every", "1"]) == 0
    first = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "global_step1" in first
    capsys.readouterr()
    assert main([*job, "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "holds another run's checkpoints" in err and "--resume" in err and "--overwrite" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == first  # nothing touched
    assert main([*job, "--out", str(run), "--overwrite", "--resume"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert main([*job, "--out", str(run), "--overwrite"]) == 0
    assert list((run / "checkpoints").iterdir()) == []  # the earlier run's checkpoints are gone
    assert (run / "final" / "model.safetensors").is_file()
    assert main([*job, "--steps", "2", "--out", str(run), "--save-every", "1", "--overwrite"]) == 0
    assert main([*job, "--steps", "3", "--out", str(run), "--resume"]) == 0  # resume is still allowed
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_the_demo_does_not_tell_to_load_what_it_removes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiered.cli import demo_finetune

    monkeypatch.setattr(demo_finetune, "QUICK_STEPS", 2)
    monkeypatch.setattr(demo_finetune, "SEQ_LEN", 32)
    out = io.StringIO()
    assert demo_finetune.run_demo(True, tmp_path, out) == 0
    text = out.getvalue()
    assert "from_pretrained" not in text and "load it with" not in text
    assert "a temporary folder, removed at the end; --out DIR keeps it" in text
    assert list(tmp_path.iterdir()) == []


def test_peft_load_line_names_the_base_model_absolutely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("peft")
    job = _job(tmp_path)
    monkeypatch.chdir(tmp_path)
    job[job.index("--model") + 1] = "m"  # relative, as a user types it
    assert main([*job, "--out", "run", "--lora", "r=4,targets=q_proj,v_proj"]) == 0
    text = capsys.readouterr().out
    assert f'AutoModelForCausalLM.from_pretrained("{(tmp_path / "m").resolve()}")' in text
    assert f'"{(tmp_path / "run" / "final").resolve()}")' in text


def test_tier_table_says_the_gpu_tier_is_host_memory_without_a_gpu() -> None:
    from tiered.finetune import tier_table

    stats = {"tiers": {"tiers": {"gpu": {"budget_bytes": 17 << 30}, "nvme": {"budget_bytes": 1 << 40}}}}
    host = tier_table(stats, gpu_is_host=True)
    assert (
        "gpu (host mem)" in host
        and 'the "gpu" tier is the compute device\'s memory, i.e. host memory' in host
    )
    real = tier_table(stats, gpu_is_host=False)
    assert "host" not in real and "\ngpu " in real
    assert ("gpu (host mem)" in tier_table(stats)) == (not torch.cuda.is_available())


def test_finetune_job_takes_frozen_options_and_leaves_them_alone(tmp_path: Path) -> None:
    from tiered.cli.finetune import finetune_job
    from tiered.cli.finetune.options import CheckpointOptions, FinetuneOptions

    job = _job(tmp_path)
    config = json.loads((tmp_path / "ds.json").read_text())
    opts = FinetuneOptions(
        model_path=tmp_path / "m",
        config=config,
        data_path=tmp_path / "d.txt",
        seq_len=16,
        steps=1,
        lr=1e-3,
        checkpoints=CheckpointOptions(tmp_path / "run"),
    )
    before, config_before = copy.deepcopy(opts), copy.deepcopy(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.steps = 2  # type: ignore[misc]
    result = finetune_job(opts, io.StringIO())
    assert opts == before and config == config_before  # nothing written into the caller's objects
    assert result.checkpoints is not None and result.checkpoints.final_path is not None
    assert job  # the CLI argv of the same run exists (the CLI builds these options from it)
