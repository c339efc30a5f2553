"""The machine DeepSpeedExamples' scripts expect, built locally: the unchanged scripts of
tests/data/deepspeed_examples/ find their Hugging Face downloads as folders of the same name in
the working directory (``tatsu-lab/alpaca``, ``wikitext``, ``roberta-base``), where transformers
and datasets look first, and the stand-ins of tests/example_env/ (torchvision's data sets, wandb)
first on PYTHONPATH. `launch` runs a script through `tiered run` (tiered, without DeepSpeed) or
through DeepSpeed's own ``deepspeed`` launcher, the same flags and arguments either way.

``python tests/deepspeed_examples_env.py WORKDIR`` builds the folders in WORKDIR, for running the
scripts by hand (docs/deepspeed.md shows the commands).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "data" / "deepspeed_examples" / "training"
STAND_INS = Path(__file__).resolve().parent / "example_env"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")

WORDS = (
    "the a model trains on data with many small steps and each step moves the weights toward a lower loss "
    "while the optimizer keeps two moments per parameter in memory that is far larger than one device"
).split()


def deepspeed_installed() -> bool:
    """DeepSpeed's own distribution is installed (``find_spec("deepspeed")`` would also find
    tiered's alias once tiered.deepspeed is imported)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(n)
    ]


def write_alpaca(cwd: Path, n: int = 24) -> Path:
    """``tatsu-lab/alpaca`` as a local folder: instruction / input / output / text records."""
    folder = cwd / "tatsu-lab" / "alpaca"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(3)
    rows = []
    for i, (ins, out) in enumerate(zip(sentences(n, 1), sentences(n, 2), strict=True)):
        inp = sentences(1, 100 + i)[0] if rng.random() < 0.5 else ""
        rows.append({"instruction": ins, "input": inp, "output": out, "text": f"{ins} {inp} {out}"})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_wikitext(cwd: Path, n: int = 64) -> Path:
    """``wikitext`` / ``wikitext-2-v1`` as a local folder (a config named in its README, as the
    Hub's), with the empty lines and trailing newlines WikiText has."""
    folder = cwd / "wikitext"
    (folder / "wikitext-2-v1").mkdir(parents=True, exist_ok=True)
    rows = [{"text": ""} if i % 5 == 0 else {"text": f" {s} \n"} for i, s in enumerate(sentences(n, 4))]
    (folder / "wikitext-2-v1" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-2-v1\n  data_files:\n  - split: train\n"
        "    path: wikitext-2-v1/train.jsonl\n---\n"
    )
    return folder


def _byte_vocab(first_id: int) -> dict[str, int]:
    from finetune_support import byte_chars

    return {c: first_id + b for b, c in byte_chars().items()}


def write_roberta_tokenizer(cwd: Path) -> Path:
    """``roberta-base``'s tokenizer as a local folder: byte-level, RoBERTa's special tokens at its
    ids (<s> 0, <pad> 1, </s> 2, <unk> 3), the bytes after them, <mask> last."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder = cwd / "roberta-base"
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)} | _byte_vocab(len(specials))
    vocab["<mask>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in [*specials, "<mask>"]])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "model_max_length": 512,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def write_llama(cwd: Path, name: str = "tiny-llama", **config: Any) -> Path:
    """A tiny Llama folder as from_pretrained reads it: config, safetensors weights (seed 0) and
    a byte-level tokenizer with an EOS and no pad token (the scripts set pad = eos)."""
    import torch
    from finetune_support import write_model
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = write_model(cwd / name, chat_template=False, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build(cwd: Path) -> Path:
    """Every folder the scripts look for, in `cwd`."""
    write_alpaca(cwd)
    write_wikitext(cwd)
    write_roberta_tokenizer(cwd)
    write_llama(cwd)
    return cwd


def stand_ins(script: Path) -> list[Path]:
    """The stand-in folders of tests/example_env/ a script gets: torchvision's only for the
    scripts that use it (transformers imports a torchvision it finds)."""
    vision = script.parent.name in ("cifar", "gan")
    return [STAND_INS / "common", *([STAND_INS / "vision"] if vision else [])]


def script_env(script: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A process environment without launcher variables, the stand-ins first on PYTHONPATH, no
    GPU, Hugging Face offline."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = os.pathsep.join(
        str(p) for p in (*stand_ins(script), ROOT, ROOT / "plugins", ROOT / "tests")
    )
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    env.update(extra or {})
    return env


def launch(
    how: str,
    script: Path,
    args: list[str],
    cwd: Path,
    *,
    launcher_flags: list[str] | None = None,
    python: str = sys.executable,
    extra_env: dict[str, str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess[str]:
    """Run `script` unchanged: ``how`` = "tiered" (``tiered run``) or "deepspeed" (DeepSpeed's
    launcher, CPU accelerator), with the same launcher flags and script arguments."""
    flags = launcher_flags or []
    env = script_env(script, extra_env)
    if how == "tiered":
        cmd = [python, "-m", "tiered.cli.main", "run", *flags, str(script), *args]
    elif how == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*stand_ins(script), ROOT / "tests"))  # no tiered
        cmd = [python, "-m", "deepspeed.launcher.runner", *flags, str(script), *args]
    else:
        raise ValueError(how)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def recorded_losses(path: Path, rank: int = 0) -> list[list[float]]:
    """The losses tests/example_env/sitecustomize.py recorded (TIERED_EXAMPLE_LOSSES=path), one
    list per engine in the order the engines first stepped."""
    by_engine: dict[int, list[float]] = {}
    for line in Path(f"{path}.rank{rank}").read_text().splitlines():
        row = json.loads(line)
        by_engine.setdefault(row["engine"], []).append(row["loss"])
    return list(by_engine.values())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(build(Path(sys.argv[1])))
