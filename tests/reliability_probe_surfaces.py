"""Issue 37's round of hostile cases, on the surfaces added since issue 23: model folders (`tiered
plan --model`, `tiered finetune --model`), the two commands' flags (``--auto-config``'s syntax,
``--bandwidth``'s bench JSON, ``--data``, ``--config``), the run folder ``--out``, weights files,
checkpoint manifests (format versions, the names they follow, permissions) and the DeepSpeed
surface (``zero.Init``, ``GatheredParameters``). Registered into tests/reliability_probe.py's
cases (which runs them, each in a worker with a time limit and an address-space limit); "before"
is what the code did before issue 37's fixes, measured (``--tree``/``--old``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hostile_support import readable_tree
from probe_support import (
    ROOT,
    Outcome,
    _env,
    _short,
    also,
    as_nobody,
    case,
    cli,
    cli_refuses,
    error_class,
    raises,
)

TINY = ROOT / "examples" / "tiny-llama"
CORPUS = ROOT / "examples" / "corpus.txt"
FINETUNE_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
}
MEMORIES = ["--gpu-mem", "8GB", "--cpu-mem", "8GB"]
ISSUE = 37


def case37(
    id: str, group: str, old: str, expected: str, check: str, slow: bool = False, timeout_s: float = 45.0
) -> Callable[[Callable[[Path], Outcome]], Callable[[Path], Outcome]]:
    return case(id, group, old, expected, check, slow=slow, timeout_s=timeout_s, issue=ISSUE)


# ---- helpers ---------------------------------------------------------------------------------
def model_dir(wd: Path, name: str = "m", **edits: Any) -> Path:
    """A copy of the tiny Llama's config.json in `wd/name`, with `edits` (None removes a key)."""
    cfg = json.loads((TINY / "config.json").read_text())
    for k, v in edits.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    d = wd / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def plan_model(d: Path, *extra: str) -> list[str]:
    return ["plan", "--model", str(d), *MEMORIES, *extra]


def finetune_args(wd: Path, model: Path | str = TINY, *extra: str, config: Path | None = None) -> list[str]:
    if config is None:
        config = wd / "ds.json"
        if not config.exists():
            config.write_text(json.dumps(FINETUNE_CONFIG))
    return [
        "finetune",
        "--model",
        str(model),
        "--config",
        str(config),
        "--data",
        str(CORPUS),
        "--steps",
        "1",
        *extra,
    ]


def bench_json(wd: Path, **doc: Any) -> Path:
    """A `tiered bench --json` file: one ok nvme result, with `doc`'s entries on top."""
    base: dict[str, Any] = {
        "methods": [
            {
                "name": "tiered backend: nvme",
                "kind": "backend",
                "status": "ok",
                "read_gbps": 2.0,
                "write_gbps": 1.5,
            }
        ]
    }
    base.update(doc)
    p = wd / "bench.json"
    p.write_text(json.dumps(base))
    return p


def weights_dir(wd: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """The tiny Llama with random weights in model.safetensors, `change`d first."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(str(TINY))
    model = AutoModelForCausalLM.from_config(cfg)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    change(state)
    d = wd / "w"
    cfg.save_pretrained(str(d))
    save_file(state, str(d / "model.safetensors"))
    return d


# ---- model folders ---------------------------------------------------------------------------
@case37(
    "model-config-nested-100k",
    "model folders",
    "RecursionError from json",
    "clear",
    "config.json nested 100,000 levels deep: tiered plan --model exits 2 naming config.json and 'nests'",
)
def _model_deep(wd: Path) -> Outcome:
    d = wd / "m"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return cli_refuses(plan_model(d), "config.json", "nests")


@case37(
    "model-config-fifo",
    "model folders",
    "reported as 'folder has no config.json'",
    "clear",
    "config.json is a FIFO: exit 2 saying it is a FIFO, without blocking",
    timeout_s=45,
)
def _model_fifo(wd: Path) -> Outcome:
    d = wd / "m"
    d.mkdir()
    os.mkfifo(d / "config.json")
    return cli_refuses(plan_model(d), "config.json", "FIFO")


@case37(
    "model-config-dev-zero",
    "model folders",
    "reported as 'folder has no config.json'",
    "clear",
    "config.json is a symlink to /dev/zero: exit 2 saying it is a character device, nothing read",
    timeout_s=45,
)
def _model_dev_zero(wd: Path) -> Outcome:
    d = wd / "m"
    d.mkdir()
    (d / "config.json").symlink_to("/dev/zero")
    return cli_refuses(plan_model(d), "config.json", "character device")


@case37(
    "model-config-is-a-folder",
    "model folders",
    "reported as 'folder has no config.json'",
    "clear",
    "config.json is a folder: exit 2 saying so",
)
def _model_config_dir(wd: Path) -> Outcome:
    d = wd / "m"
    (d / "config.json").mkdir(parents=True)
    return cli_refuses(plan_model(d), "config.json", "directory")


@case37(
    "model-config-1gb",
    "model folders",
    "read whole into memory, then a JSON error",
    "clear",
    "config.json of 1 GB (sparse): exit 2 naming its size limit, before reading it",
)
def _model_config_big(wd: Path) -> Outcome:
    d = wd / "m"
    d.mkdir()
    with open(d / "config.json", "wb") as f:
        f.truncate(1 << 30)
    return cli_refuses(plan_model(d), "config.json", "bytes or more")


@case37(
    "model-path-fifo",
    "model folders",
    "--model naming a FIFO hung reading it",
    "clear",
    "--model FIFO: exit 2 saying it is a FIFO, within the time limit",
    timeout_s=45,
)
def _model_path_fifo(wd: Path) -> Outcome:
    os.mkfifo(wd / "config.json")
    return cli_refuses(plan_model(wd / "config.json"), "FIFO")


@case37(
    "model-config-linked-like-hf-cache",
    "model folders",
    "worked",
    "fine",
    "config.json a symlink to a regular file elsewhere (as a Hugging Face cache links to blobs): plans, exit 0",
)
def _model_linked(wd: Path) -> Outcome:
    blob = wd / "blobs" / "abc123"
    blob.parent.mkdir()
    blob.write_text((TINY / "config.json").read_text())
    d = wd / "snapshot"
    d.mkdir()
    (d / "config.json").symlink_to(blob)
    rc, out, err, exc = cli(plan_model(d))
    if exc is not None or rc != 0:
        return "wrong", f"exit {rc}: {_short(str(exc) if exc else err.strip().splitlines()[-1])}"
    return "fine", "planned (exit 0) from the linked config.json"


def _size_case(wd: Path, key: str, *subs: str, **edits: Any) -> Outcome:
    return cli_refuses(plan_model(model_dir(wd, **edits)), "config.json", key, *subs)


@case37(
    "model-heads-0",
    "model folders",
    "ZeroDivisionError traceback from transformers",
    "clear",
    "num_attention_heads 0: exit 2 naming config.json and the key",
)
def _heads0(wd: Path) -> Outcome:
    return _size_case(wd, "num_attention_heads", num_attention_heads=0)


@case37(
    "model-layers-1e9",
    "model folders",
    "built on meta until memory ran out",
    "clear",
    "num_hidden_layers 1,000,000,000: exit 2 naming the key and the layer bound, in seconds",
    timeout_s=60,
)
def _layers_1e9(wd: Path) -> Outcome:
    return _size_case(wd, "num_hidden_layers", "10,000", num_hidden_layers=1_000_000_000)


@case37(
    "model-layers-negative",
    "model folders",
    "planned a model with no layers, exit 0",
    "clear",
    "num_hidden_layers -1: exit 2 naming the key",
)
def _layers_neg(wd: Path) -> Outcome:
    return _size_case(wd, "num_hidden_layers", num_hidden_layers=-1)


@case37(
    "model-layers-float",
    "model folders",
    "transformers' validation traceback",
    "clear",
    "num_hidden_layers 1e9 (a JSON float): exit 2 naming the key",
)
def _layers_float(wd: Path) -> Outcome:
    return _size_case(wd, "num_hidden_layers", num_hidden_layers=1e9)


@case37(
    "model-hidden-string",
    "model folders",
    "transformers' validation traceback",
    "clear",
    'hidden_size "big": exit 2 naming the key',
)
def _hidden_str(wd: Path) -> Outcome:
    return _size_case(wd, "hidden_size", hidden_size="big")


@case37(
    "model-hidden-negative",
    "model folders",
    "'transformers could not build ...: negative dimension', no key",
    "clear",
    "hidden_size -192: exit 2 naming the key",
)
def _hidden_neg(wd: Path) -> Outcome:
    return _size_case(wd, "hidden_size", hidden_size=-192)


@case37(
    "model-hidden-2-40",
    "model folders",
    "torch's size overflow, no key",
    "clear",
    "hidden_size 2^40: exit 2 naming the key and 'more than any machine'",
)
def _hidden_big(wd: Path) -> Outcome:
    return _size_case(wd, "hidden_size", "more than any machine", hidden_size=2**40)


@case37(
    "model-vocab-0",
    "model folders",
    "planned, exit 0",
    "clear",
    "vocab_size 0: exit 2 naming the key",
)
def _vocab0(wd: Path) -> Outcome:
    return _size_case(wd, "vocab_size", vocab_size=0)


@case37(
    "model-intermediate-0",
    "model folders",
    "planned, exit 0",
    "clear",
    "intermediate_size 0: exit 2 naming the key",
)
def _inter0(wd: Path) -> Outcome:
    return _size_case(wd, "intermediate_size", intermediate_size=0)


@case37(
    "model-kv-heads-3-of-4",
    "model folders",
    "planned, exit 0 (a layer fails only when it runs)",
    "clear",
    "4 attention heads, 3 key/value heads: exit 2 naming both keys",
)
def _kv3(wd: Path) -> Outcome:
    return _size_case(wd, "num_key_value_heads", num_key_value_heads=3)


@case37(
    "model-heads-above-hidden",
    "model folders",
    "planned with heads of 0 dimensions",
    "clear",
    "256 heads for hidden_size 192 (no head_dim): exit 2 naming both keys",
)
def _heads_big(wd: Path) -> Outcome:
    return _size_case(
        wd, "num_attention_heads", "hidden_size", num_attention_heads=256, num_key_value_heads=256
    )


@case37(
    "model-gpt2-n-head-0",
    "model folders",
    "a raw error from transformers",
    "clear",
    "a GPT-2 config.json with n_head 0: exit 2 naming n_head, the key as written",
)
def _gpt2(wd: Path) -> Outcome:
    d = wd / "g"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": 64,
                "n_head": 0,
                "n_layer": 2,
                "vocab_size": 256,
                "n_positions": 64,
            }
        )
    )
    return cli_refuses(plan_model(d), "config.json", "n_head")


@case37(
    "model-layers-null",
    "model folders",
    "transformers' validation traceback",
    "clear",
    "num_hidden_layers null: exit 2 naming config.json and the field (transformers' own check, wrapped)",
)
def _layers_null(wd: Path) -> Outcome:
    d = model_dir(wd)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    return cli_refuses(plan_model(d), "config.json", "num_hidden_layers")


@case37(
    "model-rope-theta-string",
    "model folders",
    "transformers' validation traceback",
    "clear",
    'rope_theta "fast": exit 2 naming config.json and rope_theta (transformers\' own check, wrapped)',
)
def _rope(wd: Path) -> Outcome:
    return cli_refuses(plan_model(model_dir(wd, rope_theta="fast")), "config.json", "rope_theta")


@case37(
    "model-type-number",
    "model folders",
    "a raw error",
    "clear",
    "model_type 5: exit 2 naming config.json and model_type",
)
def _model_type(wd: Path) -> Outcome:
    return cli_refuses(plan_model(model_dir(wd, model_type=5)), "config.json", "model_type")


@case37(
    "model-vocab-1e12-all-memory-given",
    "model folders",
    "searched every placement, then 'nothing fits' (exit 1)",
    "clear",
    "vocab_size 10^12 with GPU, CPU and NVMe memory given: exit 2, the weights alone exceed them, before the search",
)
def _vocab_huge(wd: Path) -> Outcome:
    d = model_dir(wd, vocab_size=10**12)
    return cli_refuses(
        ["plan", "--model", str(d), *MEMORIES, "--nvme-mem", "1TB"], "weights alone", "--nvme-mem"
    )


@case37(
    "finetune-heads-0",
    "model folders",
    "ZeroDivisionError traceback",
    "clear",
    "tiered finetune --model with num_attention_heads 0: exit 2 naming the key",
)
def _ft_heads0(wd: Path) -> Outcome:
    return cli_refuses(finetune_args(wd, model_dir(wd, num_attention_heads=0)), "num_attention_heads")


@case37(
    "finetune-layers-1e9",
    "model folders",
    "built until memory ran out",
    "clear",
    "tiered finetune --model with num_hidden_layers 10^9: exit 2 naming the key",
    timeout_s=60,
)
def _ft_layers(wd: Path) -> Outcome:
    return cli_refuses(finetune_args(wd, model_dir(wd, num_hidden_layers=10**9)), "num_hidden_layers")


@case37(
    "finetune-model-larger-than-the-host",
    "model folders",
    "the allocator's failure inside 'transformers cannot build' (or the OOM killer)",
    "clear",
    "a 2.3T-parameter config without weights (built in host memory): exit 2, weights alone vs this machine's memory",
    timeout_s=60,
)
def _ft_huge(wd: Path) -> Outcome:
    d = model_dir(
        wd,
        hidden_size=65536,
        intermediate_size=131072,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=64,
    )
    return cli_refuses(finetune_args(wd, d), "weights alone", "this machine's memory")


@case37(
    "finetune-config-json-fifo",
    "model folders",
    "reported as 'folder has no config.json'",
    "clear",
    "tiered finetune --model whose config.json is a FIFO: exit 2 saying so",
    timeout_s=45,
)
def _ft_fifo(wd: Path) -> Outcome:
    d = wd / "m"
    d.mkdir()
    os.mkfifo(d / "config.json")
    return cli_refuses(finetune_args(wd, d), "config.json", "FIFO")


@case37(
    "model-tokenizer-json-fifo",
    "model folders",
    "hung in the tokenizer's read",
    "clear",
    "a folder with tokenizer_config.json and a FIFO tokenizer.json: finetune exits 2 naming it",
    timeout_s=45,
)
def _tok_fifo(wd: Path) -> Outcome:
    d = model_dir(wd)
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    os.mkfifo(d / "tokenizer.json")
    return cli_refuses(finetune_args(wd, d), "tokenizer.json", "FIFO")


# ---- plan flags and the bench JSON -----------------------------------------------------------
@case37(
    "plan-params-1e30",
    "plan flags and bench JSON",
    "overflow traceback (torch's storage size)",
    "clear",
    "--params 1e30: exit 2 naming --params",
)
def _params(wd: Path) -> Outcome:
    return cli_refuses(["plan", "--params", "1e30", "--gpu-mem", "80GB"], "--params")


@case37(
    "plan-flops-0",
    "plan flags and bench JSON",
    "planned, exit 0",
    "clear",
    "--flops 0: exit 2 naming --flops",
)
def _flops0(wd: Path) -> Outcome:
    return cli_refuses(["plan", "--params", "100M", "--seq-len", "64", "--flops", "0", *MEMORIES], "--flops")


@case37(
    "plan-flops-nan",
    "plan flags and bench JSON",
    "planned, exit 0",
    "clear",
    "--flops nan: exit 2 naming --flops",
)
def _flops_nan(wd: Path) -> Outcome:
    return cli_refuses(
        ["plan", "--params", "100M", "--seq-len", "64", "--flops", "nan", *MEMORIES], "--flops"
    )


@case37(
    "plan-seq-len-0",
    "plan flags and bench JSON",
    "'tokens per step must be >= 1', no flag named",
    "clear",
    "--seq-len 0: exit 2 naming --seq-len",
)
def _seq0(wd: Path) -> Outcome:
    return cli_refuses(["plan", "--params", "100M", "--seq-len", "0"], "--seq-len")


@case37(
    "plan-micro-batch-0",
    "plan flags and bench JSON",
    "'tokens per step must be >= 1', no flag named",
    "clear",
    "--micro-batch 0: exit 2 naming --micro-batch",
)
def _mb0(wd: Path) -> Outcome:
    return cli_refuses(["plan", "--params", "100M", "--seq-len", "64", "--micro-batch", "0"], "--micro-batch")


@case37(
    "plan-seq-len-past-max-positions",
    "plan flags and bench JSON",
    "planned activations for sequences the model cannot run (finetune refuses them)",
    "clear",
    "--seq-len 4096 for a model of 256 positions: exit 2 naming max_position_embeddings",
)
def _seq_long(wd: Path) -> Outcome:
    return cli_refuses(
        ["plan", "--model", str(TINY), "--seq-len", "4096", *MEMORIES], "--seq-len", "max_position_embeddings"
    )


@case37(
    "plan-largest-layer-above-model",
    "plan flags and bench JSON",
    "named 'largest layer', not the flag",
    "clear",
    "--largest-layer 1e12 with a 1.7M --model: exit 2 naming --largest-layer",
)
def _largest(wd: Path) -> Outcome:
    return cli_refuses(["plan", "--model", str(TINY), "--largest-layer", "1e12"], "--largest-layer")


def _bandwidth(wd: Path, path: Path | str, *subs: str) -> Outcome:
    return cli_refuses(
        ["plan", "--params", "100M", *MEMORIES, "--bandwidth", str(path)], "--bandwidth", *subs
    )


@case37(
    "bandwidth-dev-zero",
    "plan flags and bench JSON",
    "read /dev/zero until memory ran out",
    "clear",
    "--bandwidth /dev/zero: exit 2 saying it is a character device",
    timeout_s=45,
)
def _bw_zero(wd: Path) -> Outcome:
    return _bandwidth(wd, "/dev/zero", "character device")


@case37(
    "bandwidth-fifo",
    "plan flags and bench JSON",
    "hung",
    "clear",
    "--bandwidth FIFO: exit 2 saying it is a FIFO, within the time limit",
    timeout_s=45,
)
def _bw_fifo(wd: Path) -> Outcome:
    os.mkfifo(wd / "bench.json")
    return _bandwidth(wd, wd / "bench.json", "FIFO")


@case37(
    "bandwidth-folder",
    "plan flags and bench JSON",
    "'not a JSON file ([Errno 21] Is a directory)'",
    "clear",
    "--bandwidth naming a folder: exit 2 saying it is a directory",
)
def _bw_dir(wd: Path) -> Outcome:
    return _bandwidth(wd, wd, "directory")


@case37(
    "bandwidth-read-gbps-string",
    "plan flags and bench JSON",
    "raw ValueError from a format string",
    "clear",
    'a method\'s read_gbps "fast": exit 2 naming methods[0].read_gbps',
)
def _bw_str(wd: Path) -> Outcome:
    m = {"name": "nvme", "status": "ok", "read_gbps": "fast", "write_gbps": 1.0}
    return _bandwidth(wd, bench_json(wd, methods=[m]), "methods[0].read_gbps")


@case37(
    "bandwidth-read-gbps-negative",
    "plan flags and bench JSON",
    "planned with a negative disk bandwidth",
    "clear",
    "read_gbps -2: exit 2 naming methods[0].read_gbps",
)
def _bw_neg(wd: Path) -> Outcome:
    m = {"name": "nvme", "status": "ok", "read_gbps": -2.0, "write_gbps": 1.0}
    return _bandwidth(wd, bench_json(wd, methods=[m]), "methods[0].read_gbps")


@case37(
    "bandwidth-read-gbps-nan",
    "plan flags and bench JSON",
    "planned with a NaN disk bandwidth",
    "clear",
    "read_gbps NaN (Python's JSON reads it): exit 2 naming methods[0].read_gbps",
)
def _bw_nan(wd: Path) -> Outcome:
    p = wd / "bench.json"
    p.write_text('{"methods": [{"name": "nvme", "status": "ok", "read_gbps": NaN, "write_gbps": 1.0}]}')
    return _bandwidth(wd, p, "methods[0].read_gbps")


@case37(
    "bandwidth-flops-true",
    "plan flags and bench JSON",
    "a bool taken as 1 FLOP/s",
    "clear",
    "compute.flops_per_s true: exit 2 naming compute.flops_per_s",
)
def _bw_flops_bool(wd: Path) -> Outcome:
    return _bandwidth(wd, bench_json(wd, compute={"flops_per_s": True}), "compute.flops_per_s")


@case37(
    "bandwidth-flops-0",
    "plan flags and bench JSON",
    "a rate of 0 FLOP/s planned",
    "clear",
    "compute.flops_per_s 0: exit 2 naming compute.flops_per_s",
)
def _bw_flops0(wd: Path) -> Outcome:
    return _bandwidth(wd, bench_json(wd, compute={"flops_per_s": 0}), "compute.flops_per_s")


@case37(
    "bandwidth-gpu-link-without-rates",
    "plan flags and bench JSON",
    "raw KeyError",
    "clear",
    'gpu_link {"available": true} without its rates: exit 2 naming gpu_link.h2d_gbps',
)
def _bw_link(wd: Path) -> Outcome:
    return _bandwidth(wd, bench_json(wd, gpu_link={"available": True}), "gpu_link.h2d_gbps")


@case37(
    "bandwidth-nested-100k",
    "plan flags and bench JSON",
    "RecursionError",
    "clear",
    "a bench JSON nested 100,000 deep: exit 2 naming the file and 'nests'",
)
def _bw_deep(wd: Path) -> Outcome:
    p = wd / "bench.json"
    p.write_text('{"methods": []' + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return _bandwidth(wd, p, "nests")


@case37(
    "bandwidth-1gb",
    "plan flags and bench JSON",
    "read whole into memory, then a JSON error",
    "clear",
    "a 1 GB (sparse) bench file: exit 2 naming its size limit, before reading it",
)
def _bw_big(wd: Path) -> Outcome:
    p = wd / "bench.json"
    with open(p, "wb") as f:
        f.truncate(1 << 30)
    return _bandwidth(wd, p, "bytes or more")


# ---- finetune flags and input files ----------------------------------------------------------
@case37(
    "auto-config-empty",
    "finetune flags and input files",
    "trained with an empty auto_config, exit 0",
    "clear",
    '--auto-config "": exit 2 naming --auto-config',
)
def _ac_empty(wd: Path) -> Outcome:
    return cli_refuses(finetune_args(wd, TINY, "--auto-config", ""), "--auto-config")


@case37(
    "auto-config-key-twice",
    "finetune flags and input files",
    "the last of two values taken silently, exit 0",
    "clear",
    "--auto-config cpu_mem=8GB,cpu_mem=16GB: exit 2 naming the key given twice",
)
def _ac_twice(wd: Path) -> Outcome:
    return cli_refuses(
        finetune_args(wd, TINY, "--auto-config", "cpu_mem=8GB,cpu_mem=16GB"), "cpu_mem", "twice"
    )


@case37(
    "auto-config-misspelt-key",
    "finetune flags and input files",
    "named, with the list of keys",
    "clear",
    "--auto-config cpu_memory=8GB: exit 2 naming --auto-config and cpu_mem",
)
def _ac_typo(wd: Path) -> Outcome:
    return cli_refuses(finetune_args(wd, TINY, "--auto-config", "cpu_memory=8GB"), "--auto-config", "cpu_mem")


@case37(
    "auto-config-bandwidth-fifo",
    "finetune flags and input files",
    "hung",
    "clear",
    "--auto-config cpu_mem=8GB,bandwidth=FIFO: exit 2 saying it is a FIFO, within the time limit",
    timeout_s=45,
)
def _ac_fifo(wd: Path) -> Outcome:
    os.mkfifo(wd / "bench.json")
    args = finetune_args(wd, TINY, "--auto-config", f"cpu_mem=8GB,bandwidth={wd / 'bench.json'}")
    return cli_refuses(args, "FIFO")


@case37(
    "eval-every-0",
    "finetune flags and input files",
    "taken as --steps, exit 0",
    "clear",
    "--eval-fraction 0.2 --eval-every 0: exit 2 naming --eval-every",
)
def _eval0(wd: Path) -> Outcome:
    return cli_refuses(finetune_args(wd, TINY, "--eval-fraction", "0.2", "--eval-every", "0"), "--eval-every")


@case37(
    "data-fifo",
    "finetune flags and input files",
    "hung",
    "clear",
    "--data FIFO: exit 2 saying it is a FIFO, within the time limit",
    timeout_s=45,
)
def _data_fifo(wd: Path) -> Outcome:
    os.mkfifo(wd / "d.txt")
    args = finetune_args(wd)
    args[args.index("--data") + 1] = str(wd / "d.txt")
    return cli_refuses(args, "--data", "FIFO")


@case37(
    "data-dev-zero",
    "finetune flags and input files",
    "read /dev/zero until memory ran out",
    "clear",
    "--data /dev/zero: exit 2 saying it is a character device",
    timeout_s=45,
)
def _data_zero(wd: Path) -> Outcome:
    args = finetune_args(wd)
    args[args.index("--data") + 1] = "/dev/zero"
    return cli_refuses(args, "--data", "character device")


@case37(
    "eval-data-fifo",
    "finetune flags and input files",
    "hung",
    "clear",
    "--eval-data FIFO: exit 2 saying it is a FIFO, within the time limit",
    timeout_s=45,
)
def _eval_fifo(wd: Path) -> Outcome:
    os.mkfifo(wd / "e.txt")
    return cli_refuses(finetune_args(wd, TINY, "--eval-data", str(wd / "e.txt")), "FIFO")


@case37(
    "config-fifo",
    "finetune flags and input files",
    "'no such file'",
    "clear",
    "--config FIFO: exit 2 saying it is a FIFO",
    timeout_s=45,
)
def _config_fifo(wd: Path) -> Outcome:
    os.mkfifo(wd / "c.json")
    return cli_refuses(finetune_args(wd, TINY, config=wd / "c.json"), "FIFO")


@case37(
    "config-dev-zero",
    "finetune flags and input files",
    "'no such file'",
    "clear",
    "--config /dev/zero: exit 2 saying it is a character device",
    timeout_s=45,
)
def _config_zero(wd: Path) -> Outcome:
    return cli_refuses(finetune_args(wd, TINY, config=Path("/dev/zero")), "character device")


@case37(
    "config-file-1gb",
    "finetune flags and input files",
    "read whole, then a JSON error",
    "clear",
    "a 1 GB (sparse) --config: exit 2 naming its size limit, before reading it",
)
def _config_big(wd: Path) -> Outcome:
    p = wd / "c.json"
    with open(p, "wb") as f:
        f.truncate(1 << 30)
    return cli_refuses(finetune_args(wd, TINY, config=p), "bytes or more")


# ---- the run folder (--out) ------------------------------------------------------------------
def _out_refused(wd: Path, *subs: str) -> Outcome:
    rc, out, err, exc = cli(finetune_args(wd, TINY, "--out", str(wd / "o")))
    trained = "step " in out
    if exc is not None:
        raw = ("unclear", f"traceback: {type(exc).__name__}: {_short(str(exc))}")
        return also(raw, (not trained, "only after the run trained (the model is lost)"))
    line = (err.strip().splitlines() or [""])[-1]
    if rc == 0:
        return "wrong", "exit 0"
    missing = [s for s in subs if s not in line]
    got = (
        "unclear" if missing else "clear",
        f"exit {rc}{f' without {missing}' if missing else ''}: {_short(line)}",
    )
    return also(got, (not trained, "only after the run trained (the model is lost)"))


@case37(
    "out-final-is-a-file",
    "run folder (--out)",
    "FileExistsError traceback after the whole run trained (the model lost)",
    "clear",
    "--out D with a file D/final: exit 2 naming it, before any step",
)
def _final_file(wd: Path) -> Outcome:
    (wd / "o").mkdir()
    (wd / "o" / "final").write_text("mine")
    return also(
        _out_refused(wd, "final", "regular file"),
        ((wd / "o" / "final").read_text() == "mine", "the file changed"),
    )


@case37(
    "out-checkpoints-is-a-file",
    "run folder (--out)",
    "FileExistsError traceback",
    "clear",
    "--out D with a file D/checkpoints: exit 2 naming it, before any step",
)
def _ck_file(wd: Path) -> Outcome:
    (wd / "o").mkdir()
    (wd / "o" / "checkpoints").write_text("mine")
    return _out_refused(wd, "checkpoints", "regular file")


@case37(
    "out-final-dangling-link",
    "run folder (--out)",
    "a raw error after the whole run trained",
    "clear",
    "--out D with D/final a symlink to nothing: exit 2 naming it, before any step",
)
def _final_link(wd: Path) -> Outcome:
    (wd / "o").mkdir()
    (wd / "o" / "final").symlink_to(wd / "nowhere")
    return _out_refused(wd, "final", "symlink to nothing")


@case37(
    "out-checkpoints-fifo",
    "run folder (--out)",
    "a raw error",
    "clear",
    "--out D with D/checkpoints a FIFO: exit 2 naming it, before any step",
    timeout_s=45,
)
def _ck_fifo(wd: Path) -> Outcome:
    (wd / "o").mkdir()
    os.mkfifo(wd / "o" / "checkpoints")
    return _out_refused(wd, "checkpoints", "FIFO")


_HOLD_RUN_LOCK = """
import sys, time
from tiered.checkpoint.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


@case37(
    "out-held-by-another-process",
    "run folder (--out)",
    "not refused: both runs wrote into one folder",
    "clear",
    "another live process holds D/.run.lock (as a running finetune does): finetune --out D exits 2 "
    "naming its pid, before any step",
    timeout_s=60,
)
def _held(wd: Path) -> Outcome:
    (wd / "o").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_RUN_LOCK, str(wd / "o")], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if "held" not in line:  # the old tree has no run lock: finetune meets nothing to refuse
            holder.kill()
        return _out_refused(wd, "in use by another run", f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()


@case37(
    "out-two-runs-at-once",
    "run folder (--out)",
    "both exited 0; checkpoints/ held both runs' steps and final/ the last one's",
    "clear",
    "a finetune --out D --save-every 1 running, a second (and a --resume) started on D: both refused "
    "naming the first's pid; D/checkpoints holds only the first run's steps",
    slow=True,
    timeout_s=300,
)
def _two_runs(wd: Path) -> Outcome:
    args = finetune_args(wd, TINY, "--out", str(wd / "o"), "--save-every", "1")
    args[args.index("--steps") + 1] = "400"
    first = subprocess.Popen(
        [sys.executable, "-m", "tiered.cli.main", *args], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if line.startswith("step "):
                break
        else:
            return "unclear", "the first run ended before its first step"
        deadline = time.monotonic() + 120  # its first checkpoint published (--save-every 1)
        while not (wd / "o" / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        outcomes = [
            _out_refused_args(args[:-2], f"pid {first.pid}"),
            _out_refused_args([*args[:-2], "--resume"], f"pid {first.pid}"),
        ]
        still = first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = sorted((wd / "o" / "checkpoints").glob("global_step*"))
    worst = {"wrong": 0, "unclear": 1, "fine": 2, "clear": 3}
    label = ("second run", "second run with --resume")
    got = min(
        ((o[0], f"{name}: {o[1]}") for name, o in zip(label, outcomes, strict=True)),
        key=lambda o: worst[o[0]],
    )
    return also(
        got,
        (still, "the first run had ended: nothing overlapped"),
        (bool(steps), "the first run saved nothing"),
    )


def _out_refused_args(args: list[str], *subs: str) -> Outcome:
    rc, out, err, exc = cli(args)
    if exc is not None:
        return "unclear", f"traceback: {type(exc).__name__}: {_short(str(exc))}"
    line = (err.strip().splitlines() or [""])[-1]
    if rc == 0:
        return "wrong", "the second run exited 0: it trained beside the first"
    missing = [s for s in subs if s not in line]
    return (
        "unclear" if missing else "clear",
        f"exit {rc}{f' without {missing}' if missing else ''}: {_short(line)}",
    )


# ---- weights files ---------------------------------------------------------------------------
def _int_norm(dtype: str) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        import torch

        state["model.norm.weight"] = torch.ones_like(state["model.norm.weight"], dtype=getattr(torch, dtype))

    return change


@case37(
    "weights-int32-streamed",
    "weights files",
    "trained on the integers as weights, silently",
    "clear",
    "model.norm.weight stored as int32 (the streamed load): exit 2 naming tensor, file and I32",
)
def _w_int(wd: Path) -> Outcome:
    d = weights_dir(wd, _int_norm("int32"))
    return cli_refuses(finetune_args(wd, d), "model.norm.weight", "model.safetensors", "I32")


@case37(
    "weights-bool-streamed",
    "weights files",
    "trained on the booleans as weights, silently",
    "clear",
    "model.norm.weight stored as bool: exit 2 naming tensor, file and BOOL",
)
def _w_bool(wd: Path) -> Outcome:
    d = weights_dir(wd, _int_norm("bool"))
    return cli_refuses(finetune_args(wd, d), "model.norm.weight", "model.safetensors", "BOOL")


@case37(
    "weights-int32-compare-torch",
    "weights files",
    "converted to floats and trained, silently",
    "clear",
    "the same file with --compare-torch (loaded into a real model first): exit 2 naming tensor and int32",
)
def _w_int_real(wd: Path) -> Outcome:
    d = weights_dir(wd, _int_norm("int32"))
    return cli_refuses(finetune_args(wd, d, "--compare-torch"), "model.norm.weight", "int32")


@case37(
    "weights-int64-python-api",
    "weights files",
    "trained on the integers as weights, silently",
    "clear",
    "tiered.from_pretrained on a folder with an int64 tensor: WeightsError naming tensor and file",
)
def _w_api(wd: Path) -> Outcome:
    import tiered

    WeightsError = error_class("WeightsError")
    d = weights_dir(wd, _int_norm("int64"))
    return raises(
        lambda: tiered.from_pretrained(str(d), json.loads(json.dumps(FINETUNE_CONFIG))).close(),
        WeightsError,
        "model.norm.weight",
        "I64",
    )


@case37(
    "weights-shard-fifo",
    "weights files",
    "hung opening it",
    "clear",
    "model.safetensors is a FIFO: finetune exits 2 naming it, within the time limit",
    timeout_s=45,
)
def _w_fifo(wd: Path) -> Outcome:
    d = model_dir(wd)
    os.mkfifo(d / "model.safetensors")
    return cli_refuses(finetune_args(wd, d), "model.safetensors", "FIFO")


@case37(
    "weights-index-fifo",
    "weights files",
    "ignored: the shards beside it read as if there were no index",
    "clear",
    "model.safetensors.index.json is a FIFO beside the weights: finetune exits 2 naming it",
    timeout_s=45,
)
def _w_index_fifo(wd: Path) -> Outcome:
    d = weights_dir(wd, lambda state: None)
    os.mkfifo(d / "model.safetensors.index.json")
    return cli_refuses(finetune_args(wd, d), "model.safetensors.index.json", "FIFO")


@case37(
    "weights-float64",
    "weights files",
    "trained",
    "fine",
    "every tensor stored as float64: trains one step, exit 0 (a float file for a float weight)",
)
def _w_f64(wd: Path) -> Outcome:
    def f64(state: dict[str, Any]) -> None:
        import torch

        for k in state:
            state[k] = state[k].to(torch.float64)

    rc, out, err, exc = cli(finetune_args(wd, weights_dir(wd, f64)))
    if exc is not None or rc != 0:
        return "wrong", f"exit {rc}: {_short(str(exc) if exc else err.strip().splitlines()[-1])}"
    return "fine", "trained one step from the float64 weights (exit 0)"


# ---- checkpoint manifests --------------------------------------------------------------------
def _engine_checkpoint(wd: Path) -> Path:
    """An engine checkpoint of the small MLP after one step: its tag folder."""
    from engine_support import CASES as MODELS
    from engine_support import build, ds_config, make_batches

    import tiered

    with tiered.initialize(build(MODELS["mlp"]), ds_config(param="cpu", opt="cpu")) as e:
        e.backward(e(**make_batches(MODELS["mlp"], 1, 4)[0]))
        e.step()
        return Path(e.save_checkpoint(wd / "ck"))


def _forge(tag: Path, edit: Callable[[dict[str, Any]], None], *, checksum: bool = True) -> None:
    """Edit the manifest of `tag` as a forger would: its checksum recomputed (or, `checksum`
    False, left out)."""
    from tiered.checkpoint.directory import manifest_digest

    m = json.loads((tag / "manifest.json").read_text())
    edit(m)
    m.pop("manifest_xxh3_64", None)
    if checksum:
        m["manifest_xxh3_64"] = manifest_digest(m)
    (tag / "manifest.json").write_text(json.dumps(m))


def _read_parameters(wd: Path) -> Any:
    from tiered.checkpoint import read_parameters

    return read_parameters(str(wd / "ck"))


@case37(
    "manifest-downgraded-to-v1",
    "checkpoint manifests",
    "loaded with a WARNING only (the edit taken)",
    "clear",
    "format_version rewritten to 1, checksum dropped, step counter + 5: load refused naming the version "
    "and TIERED_ACCEPT_CHECKPOINT_FORMAT; step unchanged",
)
def _downgrade(wd: Path) -> Outcome:
    from engine_support import CASES as MODELS
    from engine_support import build, ds_config

    import tiered

    CheckpointCorruptError = error_class("CheckpointCorruptError")
    tag = _engine_checkpoint(wd)

    def down(m: dict[str, Any]) -> None:
        m["format_version"] = 1
        m["training"]["global_steps"] += 5

    _forge(tag, down, checksum=False)
    with tiered.initialize(build(MODELS["mlp"]), ds_config(param="cpu", opt="cpu")) as e:
        out = raises(
            lambda: e.load_checkpoint(wd / "ck"),
            CheckpointCorruptError,
            "format version 1",
            "TIERED_ACCEPT_CHECKPOINT_FORMAT",
        )
        return also(out, (e.global_steps == 0, f"the edited step counter was loaded ({e.global_steps})"))


@case37(
    "manifest-v1-when-asked",
    "checkpoint manifests",
    "loaded with a WARNING",
    "fine",
    "a version 1 manifest (no checksum) with TIERED_ACCEPT_CHECKPOINT_FORMAT=1: loads, with a WARNING",
)
def _v1_asked(wd: Path) -> Outcome:
    from engine_support import CASES as MODELS
    from engine_support import build, ds_config
    from probe_support import Warnings

    import tiered

    tag = _engine_checkpoint(wd)
    _forge(tag, lambda m: m.update(format_version=1), checksum=False)
    os.environ["TIERED_ACCEPT_CHECKPOINT_FORMAT"] = "1"
    try:
        with Warnings() as w, tiered.initialize(build(MODELS["mlp"]), ds_config(param="cpu", opt="cpu")) as e:
            e.load_checkpoint(wd / "ck")
            steps = e.global_steps
    finally:
        del os.environ["TIERED_ACCEPT_CHECKPOINT_FORMAT"]
    return also(
        ("fine", f"loaded (global step {steps}) with a WARNING"),
        (steps == 1, "the step counter was not restored"),
        (w.has("format version 1"), "no WARNING about the missing checksum"),
    )


@case37(
    "manifest-version-true",
    "checkpoint manifests",
    "true == 1 to Python: read as version 1, loaded with a WARNING",
    "clear",
    "format_version true (checksum dropped): refused as not a version number",
)
def _version_true(wd: Path) -> Outcome:
    tag = _engine_checkpoint(wd)
    _forge(tag, lambda m: m.update(format_version=True), checksum=False)
    return raises(lambda: _read_parameters(wd), error_class("CheckpointCorruptError"), "format_version True")


def _forged_layout(wd: Path, edit: Callable[[dict[str, Any]], None], *subs: str) -> Outcome:
    tag = _engine_checkpoint(wd)
    _forge(tag, edit)
    return raises(lambda: _read_parameters(wd), error_class("CheckpointCorruptError"), "manifest.json", *subs)


@case37(
    "manifest-rank-file-etc-passwd",
    "checkpoint manifests",
    "raw KeyError",
    "clear",
    "a forged manifest (checksum recomputed) whose ranks[0].file is /etc/passwd: refused naming ranks[0].file",
)
def _passwd(wd: Path) -> Outcome:
    return _forged_layout(
        wd, lambda m: m["ranks"][0].update(file="/etc/passwd"), "ranks[0].file", "/etc/passwd"
    )


@case37(
    "manifest-rank-file-dotdot",
    "checkpoint manifests",
    "raw KeyError",
    "clear",
    "a forged manifest whose ranks[0].file is ../other/rank00000.safetensors: refused naming ranks[0].file",
)
def _dotdot(wd: Path) -> Outcome:
    return _forged_layout(
        wd, lambda m: m["ranks"][0].update(file="../other/rank00000.safetensors"), "ranks[0].file"
    )


@case37(
    "manifest-files-etc-passwd",
    "checkpoint manifests",
    "refused: 'lists a file outside its checkpoint folder'",
    "clear",
    "a forged manifest whose files names /etc/passwd: refused naming it",
)
def _files_passwd(wd: Path) -> Outcome:
    def add(m: dict[str, Any]) -> None:
        m["files"]["/etc/passwd"] = {"bytes": 0, "xxh3_64": "0"}

    return _forged_layout(wd, add, "/etc/passwd")


@case37(
    "manifest-piece-offset-text",
    "checkpoint manifests",
    "raw ValueError from int()",
    "clear",
    'a forged manifest with a piece\'s start_in_shard "abc": refused naming the field',
)
def _piece_text(wd: Path) -> Outcome:
    def edit(m: dict[str, Any]) -> None:
        next(iter(m["parameters"].values()))["pieces"][0]["start_in_shard"] = "abc"

    return _forged_layout(wd, edit, "start_in_shard")


@case37(
    "manifest-ranks-not-a-list",
    "checkpoint manifests",
    "raw TypeError",
    "clear",
    "a forged manifest with ranks 5: refused naming ranks",
)
def _ranks5(wd: Path) -> Outcome:
    return _forged_layout(wd, lambda m: m.update(ranks=5), "ranks")


@case37(
    "manifest-piece-unknown-group",
    "checkpoint manifests",
    "raw KeyError",
    "clear",
    "a forged manifest whose piece names group g9999: refused naming the piece and the group",
)
def _piece_group(wd: Path) -> Outcome:
    def edit(m: dict[str, Any]) -> None:
        next(iter(m["parameters"].values()))["pieces"][0]["group"] = "g9999"

    return _forged_layout(wd, edit, "g9999")


def _unreadable(wd: Path, target: Callable[[Path], Path], read: Callable[[], Any], *subs: str) -> Outcome:
    tag = _engine_checkpoint(wd)
    readable_tree(wd)
    os.chmod(target(tag), 0)
    CheckpointPathError = error_class("CheckpointPathError")
    return as_nobody(lambda: raises(read, CheckpointPathError, "permission denied", "uid 65534", *subs))


@case37(
    "checkpoint-manifest-mode-000",
    "checkpoint manifests",
    "'cannot be read: [Errno 13]' called corrupt, no user named",
    "clear",
    "manifest.json mode 000, read by a user who is not its owner: refused naming the file and the user",
)
def _m000(wd: Path) -> Outcome:
    return _unreadable(wd, lambda t: t / "manifest.json", lambda: _read_parameters(wd), "manifest.json")


@case37(
    "checkpoint-tag-folder-mode-000",
    "checkpoint manifests",
    "'is not a complete checkpoint'",
    "clear",
    "the tag folder latest names mode 000: refused naming that folder and the user",
)
def _t000(wd: Path) -> Outcome:
    return _unreadable(wd, lambda t: t, lambda: _read_parameters(wd), "global_step1")


@case37(
    "checkpoint-rank-file-mode-000",
    "checkpoint manifests",
    "raw PermissionError",
    "clear",
    "rank00000.safetensors mode 000: refused naming the file and the user",
)
def _r000(wd: Path) -> Outcome:
    return _unreadable(wd, lambda t: t / "rank00000.safetensors", lambda: _read_parameters(wd), "rank00000")


@case37(
    "checkpoint-latest-mode-000",
    "checkpoint manifests",
    "raw PermissionError",
    "clear",
    "latest mode 000: refused naming it and the user",
)
def _l000(wd: Path) -> Outcome:
    return _unreadable(wd, lambda t: t.parent / "latest", lambda: _read_parameters(wd), "latest")


@case37(
    "checkpoint-newest-unreadable",
    "checkpoint manifests",
    "find_latest_valid skipped it silently and named an older checkpoint (a resume would go back)",
    "clear",
    "the newest of two checkpoints mode 000: find_latest_valid refuses naming it, not the older one",
)
def _newest(wd: Path) -> Outcome:
    from tiered.checkpoint import find_latest_valid, save_tensors

    save_tensors(wd / "ck", "a", {"w": __import__("torch").ones(4)}, {"counters": {"global_steps": 1}})
    save_tensors(wd / "ck", "b", {"w": __import__("torch").ones(4)}, {"counters": {"global_steps": 2}})
    readable_tree(wd)
    os.chmod(wd / "ck" / "b", 0)
    CheckpointPathError = error_class("CheckpointPathError")

    def find() -> Outcome:
        try:
            got = find_latest_valid(str(wd / "ck"))
        except CheckpointPathError as e:
            return (
                ("clear", f"{type(e).__name__}: {_short(str(e))}")
                if "ck/b" in str(e)
                else ("unclear", str(e))
            )
        except Exception as e:  # noqa: BLE001
            return "unclear", f"raw {type(e).__name__}: {_short(str(e))}"
        return "wrong", f"named {got!r}, skipping the newest without a word"

    return as_nobody(find)


# ---- the DeepSpeed surface -------------------------------------------------------------------
def _init(**kw: Any) -> Any:
    import tiered.deepspeed as deepspeed

    return deepspeed.zero.Init(**kw)


def _usage(fn: Callable[[], Any], *subs: str) -> Outcome:
    return raises(fn, (error_class("UsageError"), error_class("ConfigError")), *subs)


@case37(
    "zero-init-config-42",
    "DeepSpeed surface",
    "raw TypeError from os.fspath",
    "clear",
    "zero.Init(config_dict_or_path=42): an error naming the argument and DeepSpeed's form",
)
def _init42(wd: Path) -> Outcome:
    return _usage(lambda: _init(config_dict_or_path=42), "config_dict_or_path=42", "DeepSpeed's form")


@case37(
    "zero-init-config-list",
    "DeepSpeed surface",
    "raw TypeError",
    "clear",
    "zero.Init(config_dict_or_path=[]): an error naming the argument and DeepSpeed's form",
)
def _init_list(wd: Path) -> Outcome:
    return _usage(lambda: _init(config_dict_or_path=[]), "config_dict_or_path", "DeepSpeed's form")


@case37(
    "zero-init-zero-optimization-list",
    "DeepSpeed surface",
    "raw AttributeError ('list' has no attribute 'get')",
    "clear",
    'zero.Init(config_dict_or_path={"zero_optimization": []}): an error naming zero_optimization',
)
def _init_zero_list(wd: Path) -> Outcome:
    return _usage(
        lambda: _init(config_dict_or_path={"zero_optimization": []}), "zero_optimization", "JSON object"
    )


@case37(
    "zero-init-stage-string",
    "DeepSpeed surface",
    "'stage is 3; ... which is ZeRO stage 3' (the string '3' shown as 3)",
    "clear",
    "zero.Init with stage \"3\": an error showing '3' as a string",
)
def _init_stage(wd: Path) -> Outcome:
    return _usage(lambda: _init(config_dict_or_path={"zero_optimization": {"stage": "3"}}), "stage is '3'")


@case37(
    "zero-init-config-fifo",
    "DeepSpeed surface",
    "hung",
    "clear",
    "zero.Init(config_dict_or_path=FIFO): an error saying it is a FIFO, within the time limit",
    timeout_s=45,
)
def _init_fifo(wd: Path) -> Outcome:
    os.mkfifo(wd / "ds.json")
    return _usage(lambda: _init(config_dict_or_path=str(wd / "ds.json")), "FIFO")


def _gathered(params: Any, **kw: Any) -> Any:
    import tiered.deepspeed as deepspeed

    return deepspeed.zero.GatheredParameters(params, **kw)


@case37(
    "gathered-parameters-name",
    "DeepSpeed surface",
    "raw AttributeError ('str' has no attribute 'device')",
    "clear",
    'GatheredParameters("a.weight"): an error naming params and DeepSpeed\'s form',
)
def _gp_name(wd: Path) -> Outcome:
    return _usage(lambda: _gathered("a.weight"), "params='a.weight'", "DeepSpeed's form")


@case37(
    "gathered-parameters-int",
    "DeepSpeed surface",
    "a TypeError without DeepSpeed's form",
    "clear",
    "GatheredParameters(5): an error naming params and DeepSpeed's form",
)
def _gp_int(wd: Path) -> Outcome:
    return _usage(lambda: _gathered(5), "params=5", "DeepSpeed's form")


@case37(
    "gathered-parameters-list-of-names",
    "DeepSpeed surface",
    "raw AttributeError",
    "clear",
    'GatheredParameters(["a.weight"]): an error naming the item and DeepSpeed\'s form',
)
def _gp_names(wd: Path) -> Outcome:
    return _usage(lambda: _gathered(["a.weight"]), "'a.weight'", "DeepSpeed's form")


@case37(
    "gathered-parameters-modifier-rank-text",
    "DeepSpeed surface",
    "'modifier_rank=0 ... modify on rank 0 (modifier_rank=0)' for the string '0'",
    "clear",
    'GatheredParameters(p, modifier_rank="0"): an error naming modifier_rank as a string',
)
def _gp_rank(wd: Path) -> Outcome:
    import torch

    p = torch.nn.Parameter(torch.ones(2))
    return _usage(lambda: _gathered(p, modifier_rank="0"), "modifier_rank='0'")


def _init_model() -> Any:
    import torch

    with _init():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


@case37(
    "zero-init-model-called-before-initialize",
    "DeepSpeed surface",
    "torch's 'Tensor on device meta is not on the expected device cpu!'",
    "clear",
    "a model built under zero.Init, called before initialize: an error naming zero.Init and initialize",
)
def _init_call(wd: Path) -> Outcome:
    import torch

    model = _init_model()
    return raises(
        lambda: model(torch.ones(1, 4)),
        error_class("ModelNotInitializedError"),
        "zero.Init",
        "deepspeed.initialize",
    )


@case37(
    "zero-init-model-meta-input-before-initialize",
    "DeepSpeed surface",
    "returned a meta tensor: no values, no error",
    "clear",
    "the same model called on a meta input: the same error, not a meta output",
)
def _init_meta(wd: Path) -> Outcome:
    import torch

    model = _init_model()
    return raises(
        lambda: model(torch.ones(1, 4, device="meta")), error_class("ModelNotInitializedError"), "zero.Init"
    )


@case37(
    "zero-init-model-after-initialize",
    "DeepSpeed surface",
    "worked",
    "fine",
    "the same model after deepspeed.initialize: engine(x) runs and a step trains",
)
def _init_after(wd: Path) -> Outcome:
    import torch

    import tiered.deepspeed as deepspeed

    model = _init_model()
    engine, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3},
        },
    )
    try:
        y = engine(torch.ones(1, 4))
        engine.backward(y.square().sum())
        engine.step()
        ok = bool(torch.isfinite(y).all())
    finally:
        engine.close()
    return ("fine", "engine(x) ran and one step trained") if ok else ("wrong", "a non-finite output")
