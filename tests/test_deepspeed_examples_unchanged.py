"""DeepSpeedExamples' scripts, not one line changed (tests/data/deepspeed_examples/), run through
`tiered run` in this environment, which has no DeepSpeed: every ``deepspeed`` import in them is
tiered's. Each runs small (its own flags; the data it would download built locally,
tests/deepspeed_examples_env.py) and trains; where DeepSpeed is installed, the slow
``deepspeed``-marked tests run each one through DeepSpeed's own launcher too and compare the losses
(tests/example_env/common/sitecustomize.py records every loss passed to ``engine.backward``).

The DCGAN script (training/gan/) calls ``torch.cuda.set_device`` and builds its tensors on
``cuda``: unchanged, it runs only where CUDA is (its test is marked ``cuda``); its port with the
CUDA lines replaced is examples/deepspeed_examples/ (tests/test_deepspeed_examples.py)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import deepspeed_examples_env as env
import pytest
import torch

README = Path(env.SCRIPTS).parent / "README.md"
SEED = {"TIERED_EXAMPLE_SEED": "0"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return env.build(tmp_path_factory.mktemp("examples"))


def run_script(
    how: str,
    script: str,
    args: list[str],
    cwd: Path,
    tag: str,
    *,
    flags: list[str] | None = None,
    extra: Any = None,
) -> tuple[list[list[float]], Any]:
    losses = cwd / f"losses-{tag}-{how}"
    for old in cwd.glob(losses.name + ".rank*"):
        old.unlink()
    proc = env.launch(
        how,
        env.SCRIPTS / script,
        args,
        cwd,
        launcher_flags=flags,
        extra_env={**SEED, "TIERED_EXAMPLE_LOSSES": str(losses), **(extra or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return env.recorded_losses(losses), proc


def trained(losses: list[float]) -> None:
    assert losses and all(math.isfinite(x) for x in losses)
    assert len(set(losses)) > 1  # the weights moved


def test_the_scripts_are_deepspeedexamples_own_unchanged() -> None:
    """Every vendored file has the hash the README records for the upstream file, and imports
    DeepSpeed under its own name (nothing in it was ported)."""
    table = dict(re.findall(r"^\| `(training/[^`]+)` \| `([0-9a-f]{16})` \|$", README.read_text(), re.M))
    files = sorted(str(p.relative_to(env.SCRIPTS.parent)) for p in env.SCRIPTS.rglob("*") if p.is_file())
    files = [f for f in files if not f.endswith("LICENSE")]
    assert sorted(table) == files
    for name, digest in table.items():
        data = (env.SCRIPTS.parent / name).read_bytes()
        assert hashlib.sha256(data).hexdigest()[:16] == digest, name
        if name.endswith(".py") and "gan_model" not in name and "gan/utils" not in name:
            assert re.search(rb"^import deepspeed\r?$", data, re.M), name
            assert b"tiered" not in data


CIFAR = ["--epochs", "1", "--stage", "3", "--dtype", "fp32", "--log-interval", "4", "--deepspeed"]
CIFAR_DATA = {"TIERED_FAKE_CIFAR10_TRAIN": "128", "TIERED_FAKE_CIFAR10_TEST": "32"}
BERT = [
    *("--num_iterations", "7", "--checkpoint_every", "4", "--log_every", "1", "--num_layers", "2"),
    *("--num_heads", "2", "--ff_dim", "64", "--h_dim", "32", "--batch_size", "4", "--max_seq_length", "32"),
]
SUPEROFFLOAD_CONFIG = {  # the "zerooffload" config of finetune_llama-8b_1gpu.sh, batch 2
    "train_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "reduce_bucket_size": 4e8,
        "sub_group_size": 4e8,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "wall_clock_breakdown": True,
}
SUPEROFFLOAD = [
    *("--model_name", "tiny-llama", "--num_train_epochs", "1", "--lr", "1e-5", "--batch_size", "2"),
    *("--weight_decay", "0.01", "--seed", "42", "--max_length", "32", "--log_interval", "1"),
    *("--dataset_name", "tatsu-lab/alpaca", "--bench_steps", "6", "--warmup_steps", "2"),
    *("--activation_checkpointing", "--attn_implementation", "eager", "--log_level", "DEBUG"),
]
ZENFLOW = [
    *("--model_name", "tiny-llama", "--num_train_epochs", "1", "--lr", "2e-5", "--batch_size", "2"),
    *("--weight_decay", "0.01", "--seed", "42"),
]


def zenflow_config(cwd: Path) -> Path:
    """zf_config.json as DeepSpeedExamples has it, with batch 2 and without its ``zenflow``
    section (ZenFlow's top-k update is another optimizer: tiered refuses the section)."""
    cfg = json.loads((env.SCRIPTS / "DeepSpeed-ZenFlow/finetuning/zf_config.json").read_text())
    cfg["train_batch_size"] = 2
    del cfg["zero_optimization"]["zenflow"]
    path = cwd / "zf_config_no_zenflow.json"
    path.write_text(json.dumps(cfg))
    return path


def test_cifar_zero3_runs_unchanged(workdir: Path) -> None:
    """CIFAR (ZeRO-3, fp32; ``int(os.environ["LOCAL_RANK"])``, ``get_accelerator().set_device``,
    ``torch.distributed.barrier()``, the MoE group splitter not used) trains over the loader
    ``deepspeed.initialize`` returns and runs its test pass."""
    losses, proc = run_script(
        "tiered", "cifar/cifar10_deepspeed.py", CIFAR, workdir, "cifar", extra=CIFAR_DATA
    )
    assert len(losses) == 1 and len(losses[0]) == 8  # 128 images, train_batch_size 16
    trained(losses[0])
    assert (
        "Finished Training" in proc.stdout and "Accuracy of the network on the 32 test images" in proc.stdout
    )


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_hello_deepspeed_bert_runs_unchanged(workdir: Path) -> None:
    """HelloDeepSpeed's BERT MLM (ZeRO-1 config, bf16, fire's flags, the WikiText and roberta-base
    folders) trains and saves its checkpoints with the engine's save_checkpoint."""
    ckpt = workdir / "bert"
    losses, proc = run_script(
        "tiered", "HelloDeepSpeed/train_bert_ds.py", [*BERT, "--checkpoint_dir", str(ckpt)], workdir, "bert"
    )
    assert len(losses) == 1 and len(losses[0]) == 6  # steps 1..6 (the script stops at num_iterations)
    trained(losses[0])
    (exp,) = ckpt.iterdir()
    assert (exp / "latest").exists() and (exp / "hparams.json").exists()
    assert "Total number of model parameters" in proc.stderr


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_superoffload_finetune_runs_unchanged(workdir: Path) -> None:
    """DeepSpeed-SuperOffload's finetune_zero3.py (DeepSpeedCPUAdam built by the script, `from
    deepspeed import comm as dist`, set_z3 leaf modules unused, activation checkpointing) with its
    ZeRO-Offload config: trains, and counts the model's parameters through ``ds_numel`` (the
    "Model size" it logs is the model's, not 0)."""
    cfg = workdir / "superoffload_zerooffload.json"
    cfg.write_text(json.dumps(SUPEROFFLOAD_CONFIG))
    args = [f"--deepspeed_config={cfg}", *SUPEROFFLOAD, "--output_dir", str(workdir / "so_out")]
    losses, proc = run_script(
        "tiered", "DeepSpeed-SuperOffload/finetune_zero3.py", args, workdir, "superoffload"
    )
    assert len(losses) == 1 and len(losses[0]) == 6
    trained(losses[0])
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(workdir / "tiny-llama"))
    size = sum(p.numel() for p in model.parameters())
    assert f"Model size: {size:,} parameters" in proc.stderr, re.findall(r"Model size: .*", proc.stderr)


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_zenflow_finetune_runs_unchanged(workdir: Path) -> None:
    """DeepSpeed-ZenFlow's finetune_llama.py (``load_dataset("tatsu-lab/alpaca")`` hard-coded,
    `from deepspeed import comm as dist`, the config's AdamW and clipping, save_checkpoint and
    tokenizer.save_pretrained at the end)."""
    out = workdir / "zf_out"
    args = [f"--deepspeed_config={zenflow_config(workdir)}", *ZENFLOW, "--output_dir", str(out)]
    losses, proc = run_script(
        "tiered", "DeepSpeed-ZenFlow/finetuning/finetune_llama.py", args, workdir, "zenflow"
    )
    assert len(losses) == 1 and len(losses[0]) == 12  # 24 records, batch 2
    trained(losses[0])
    assert "Training complete!" in proc.stdout
    assert (out / "latest").exists() and (out / "tokenizer_config.json").exists()


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_zenflow_config_as_shipped_is_refused_naming_zenflow(workdir: Path) -> None:
    cfg = env.SCRIPTS / "DeepSpeed-ZenFlow/finetuning/zf_config.json"
    proc = env.launch(
        "tiered",
        env.SCRIPTS / "DeepSpeed-ZenFlow/finetuning/finetune_llama.py",
        [f"--deepspeed_config={cfg}", *ZENFLOW, "--output_dir", str(workdir / "zf_refused")],
        workdir,
    )
    assert proc.returncode != 0
    assert "zero_optimization.zenflow" in proc.stderr and "ZenFlow is not supported" in proc.stderr


@pytest.mark.slow
def test_cifar_on_two_ranks_through_torchrun(workdir: Path) -> None:
    """``tiered run --num_gpus 2``: two processes through torchrun, each with its --local_rank and
    LOCAL_RANK (the script reads both), training on its half of each batch."""
    run_script(
        "tiered",
        "cifar/cifar10_deepspeed.py",
        CIFAR,
        workdir,
        "cifar2",
        flags=["--num_gpus", "2"],
        extra=CIFAR_DATA,
    )
    ranks = sorted(workdir.glob("losses-cifar2-tiered.rank*"))
    assert [p.name[-1] for p in ranks] == ["0", "1"]
    for path in ranks:
        (rank_losses,) = env.recorded_losses(workdir / "losses-cifar2-tiered", int(path.name[-1]))
        assert len(rank_losses) == 8
        trained(rank_losses)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the unchanged DCGAN script needs CUDA (torch.cuda.set_device)"
)
def test_gan_runs_unchanged_on_cuda(workdir: Path) -> None:
    cfg = env.SCRIPTS / "gan/gan_deepspeed_config.json"
    args = [
        "--dataset",
        "fake",
        "--deepspeed_config",
        str(cfg),
        "--batchSize",
        "8",
        "--imageSize",
        "64",
        "--workers",
        "0",
    ]
    args += ["--outf", str(workdir / "gan_out"), "--tensorboard_path", str(workdir / "gan_tb")]
    losses, _ = run_script(
        "tiered", "gan/gan_deepspeed_train.py", args, workdir, "gan", extra={"CUDA_VISIBLE_DEVICES": "0"}
    )
    assert len(losses) == 2  # the discriminator's and the generator's engines
    for per_engine in losses:
        trained(per_engine)


# ---- against DeepSpeed itself ---------------------------------------------------------------

DS_CASES: dict[str, tuple[str, list[str], dict[str, str], float]] = {
    # script, arguments, environment, relative tolerance per loss. fp32 scripts: 1e-5. The bf16
    # ones compare bf16 losses: tiered's and DeepSpeed's fp32 masters round to bf16 weights
    # apart by a bf16 step now and then (2^-8 relative), which moves a loss by one bf16 step.
    "cifar": ("cifar/cifar10_deepspeed.py", CIFAR, CIFAR_DATA, 1e-5),
    "bert": ("HelloDeepSpeed/train_bert_ds.py", BERT, {}, 2**-7),
    "superoffload": ("DeepSpeed-SuperOffload/finetune_zero3.py", SUPEROFFLOAD, {}, 2**-7),
    "zenflow": ("DeepSpeed-ZenFlow/finetuning/finetune_llama.py", ZENFLOW, {}, 2**-7),
}


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(not env.deepspeed_installed(), reason="DeepSpeed is not installed")
@pytest.mark.parametrize("case", sorted(DS_CASES))
def test_each_unchanged_script_trains_equal_to_deepspeed(workdir: Path, case: str) -> None:
    """The same unchanged script, the same flags and seeds, through `tiered run` and through
    DeepSpeed's launcher (its CPU accelerator): the same loss at every step."""
    script, args, extra, rel = DS_CASES[case]
    runs = {}
    for how in ("tiered", "deepspeed"):
        cwd = workdir / f"{case}-{how}"
        if cwd.exists():
            shutil.rmtree(cwd)
        shutil.copytree(workdir, cwd, ignore=shutil.ignore_patterns("losses-*", "*-tiered", "*-deepspeed"))
        a = list(args)
        if case == "bert":
            a += ["--checkpoint_dir", str(cwd / "ckpt")]
        elif case == "superoffload":
            (cwd / "cfg.json").write_text(json.dumps(SUPEROFFLOAD_CONFIG))
            a = [f"--deepspeed_config={cwd / 'cfg.json'}", *a, "--output_dir", str(cwd / "out")]
        elif case == "zenflow":
            a = [f"--deepspeed_config={zenflow_config(cwd)}", *a, "--output_dir", str(cwd / "out")]
        flags = ["--num_gpus", "1"] if how == "deepspeed" else []
        runs[how], _ = run_script(how, script, a, cwd, case, flags=flags, extra=extra)
    ours, theirs = runs["tiered"], runs["deepspeed"]
    assert [len(x) for x in ours] == [len(x) for x in theirs]
    for step, (a_, b_) in enumerate(zip(ours[0], theirs[0], strict=True)):
        assert a_ == pytest.approx(b_, rel=rel), f"{case} step {step}: tiered {a_}, DeepSpeed {b_}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
