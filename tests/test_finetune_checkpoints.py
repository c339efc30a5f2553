"""`tiered finetune --out DIR`: checkpoints, --resume bit for bit, --keep-last, SIGTERM saves,
the final export (full and LoRA). See [Note: run directory] and [Note: stop on a signal]."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from finetune_support import assert_bitwise_equal, checkpoint_job, final_weights
from safetensors.torch import load_file

from tiered.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def job(tmp_path: Path) -> list[str]:
    return checkpoint_job(tmp_path, repeats=30)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    return env


def test_resume_is_bitwise_the_uninterrupted_run(
    tmp_path: Path, job: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*job, "--steps", "4", "--out", str(whole)]) == 0
    out = capsys.readouterr().out
    assert f'AutoModelForCausalLM.from_pretrained("{whole / "final"}")' in out
    assert main([*job, "--steps", "2", "--out", str(parts), "--save-every", "2"]) == 0
    first = final_weights(parts)
    assert (parts / "checkpoints" / "global_step2" / "manifest.json").is_file()
    capsys.readouterr()
    assert main([*job, "--steps", "4", "--out", str(parts), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "global_step2" in out
    assert "step     3/4" in out and "step     1/4" not in out  # it continued, not restarted
    want = final_weights(whole)
    assert_bitwise_equal(final_weights(parts), want)
    assert any(not torch.equal(first[k], want[k]) for k in want)  # steps 3 and 4 did change it
    # the export is what transformers loads, with the tokenizer files next to it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(whole / "final"))
    for k, v in loaded.state_dict().items():
        if k in want:
            assert torch.equal(v, want[k]), k
    assert AutoTokenizer.from_pretrained(str(whole / "final")).eos_token == "</s>"


def test_resume_in_a_subprocess(tmp_path: Path, job: list[str]) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*job, "--steps", "3", "--out", str(whole)]) == 0
    assert main([*job, "--steps", "3", "--out", str(parts), "--save-every", "1"]) == 0
    ckpts = parts / "checkpoints"
    # start over from step 1's checkpoint, in a new process
    (parts / "final" / "model.safetensors").unlink()
    cmd = [sys.executable, "-m", "tiered.cli.main", *job, "--steps", "3", "--out", str(parts)]
    r = subprocess.run(
        [*cmd, "--resume", str(ckpts / "global_step1")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "step     2/3" in r.stdout and "step     1/3" not in r.stdout
    assert_bitwise_equal(final_weights(parts), final_weights(whole))


def test_sigterm_saves_a_checkpoint_and_resume_finishes_the_run(tmp_path: Path, job: list[str]) -> None:
    steps = 12
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    cmd = [sys.executable, "-m", "tiered.cli.main", *job, "--steps", str(steps), "--out", str(parts)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step     2/"):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(seen)
    rest, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    text = "".join(seen) + rest
    assert "checkpoint saved:" in text and "--resume" in text, text
    assert not (parts / "final").exists()  # it stopped early: no export of a half-trained model
    done = json.loads(
        (parts / "checkpoints" / (parts / "checkpoints" / "latest").read_text() / "manifest.json").read_text()
    )["training"]["global_steps"]
    assert 2 <= done < steps
    assert main([*job, "--steps", str(steps), "--out", str(parts), "--resume"]) == 0
    assert main([*job, "--steps", str(steps), "--out", str(whole)]) == 0
    assert_bitwise_equal(final_weights(parts), final_weights(whole))


def test_no_save_on_interrupt_leaves_sigterm_alone(tmp_path: Path, job: list[str]) -> None:
    parts = tmp_path / "parts"
    cmd = [sys.executable, "-m", "tiered.cli.main", *job, "--steps", "50", "--out", str(parts)]
    proc = subprocess.Popen(
        [*cmd, "--no-save-on-interrupt"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step     1/"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGTERM
    assert not list((parts / "checkpoints").glob("global_step*"))


def test_keep_last_prunes_but_never_latest(tmp_path: Path, job: list[str]) -> None:
    out = tmp_path / "run"
    umask = os.umask(0o022)
    try:
        assert main([*job, "--steps", "4", "--out", str(out), "--save-every", "1", "--keep-last", "2"]) == 0
    finally:
        os.umask(umask)
    ckpts = out / "checkpoints"
    # owner only, as the swap files ([Note: private checkpoints]); the export is ordinary
    assert stat.S_IMODE(ckpts.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in ckpts.rglob("*") if p.is_file()} == {0o600}
    assert stat.S_IMODE((out / "final" / "config.json").stat().st_mode) == 0o644
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == [
        "global_step3",
        "global_step4",
        "latest",
    ]
    from tiered.finetune.checkpointing import CheckpointPolicy

    # `latest` pointing at an older tag (as after a manual rollback) keeps that one
    (ckpts / "latest").write_text("global_step3")
    policy = CheckpointPolicy(out)
    assert policy.prune(1) == []
    (ckpts / "latest").write_text("global_step4")
    assert policy.prune(1) == [str(ckpts / "global_step3")]


def test_checkpoint_options_need_out_and_bad_resume_paths(
    tmp_path: Path, job: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*job, "--save-every", "2"]) == 2
    assert "--save-every needs --out DIR" in capsys.readouterr().err
    assert main([*job, "--out", str(tmp_path / "r"), "--resume", str(tmp_path / "nope")]) == 2
    assert f"--resume {tmp_path / 'nope'}: no such checkpoint" in capsys.readouterr().err
    assert main([*job, "--out", str(tmp_path / "r"), "--resume"]) == 2
    assert "no complete checkpoint under" in capsys.readouterr().err
    assert main([*job, "--out", str(tmp_path / "r"), "--merge-lora"]) == 2
    assert "--merge-lora needs --lora" in capsys.readouterr().err


def test_lora_export_is_peft_format_and_merged(
    tmp_path: Path, job: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    spec = "r=4,alpha=8,targets=q_proj,v_proj"
    assert (
        main([*job, "--steps", "3", "--out", str(out), "--lora", spec, "--merge-lora", "--lr", "1e-2"]) == 0
    )
    text = capsys.readouterr().out
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert "PeftModel.from_pretrained(" in text and str(final) in text
    # the base exactly as the run built it (config only, seeded), with the adapter loaded onto it
    from tiered.finetune import build_model, resolve_model

    base = build_model(resolve_model(tmp_path / "m"), seed=0)
    peft_model = peft.PeftModel.from_pretrained(base, str(final))
    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(float(v.abs().sum()) > 0 for k, v in adapter.items() if "lora_B" in k)  # it learned
    lora_b = {n: p for n, p in peft_model.named_parameters() if "lora_B" in n}
    assert lora_b and all(float(p.abs().sum()) > 0 for p in lora_b.values())
    merged = AutoModelForCausalLM.from_pretrained(str(final / "merged"))
    want = peft_model.merge_and_unload().state_dict()
    for k, v in merged.state_dict().items():
        assert torch.allclose(v, want[k], atol=1e-6), k


@pytest.mark.slow  # the 40B/400B plan: about a minute and a half on two cores
def test_demo_exports_through_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from tiered.cli import demo_finetune

    monkeypatch.setattr(demo_finetune, "QUICK_STEPS", 2)
    monkeypatch.setattr(demo_finetune, "SEQ_LEN", 32)
    out = io.StringIO()
    work = tmp_path / "work"
    work.mkdir()
    assert demo_finetune.run_demo(True, work, out, run_dir=tmp_path / "run") == 0
    text = out.getvalue()
    assert f'AutoModelForCausalLM.from_pretrained("{tmp_path / "run" / "final"}")' in text
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert list(work.iterdir()) == []  # the offload files were temporary; the run folder is kept
