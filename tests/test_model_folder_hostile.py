"""Hostile model folders for `tiered plan --model` and `tiered finetune --model` (issue 37, item 2):
config.json read as [Note: files a user names] says, its sizes checked before anything is built
([Note: plausible model sizes]), transformers' own validation named with the file and key, and
a model whose weights alone exceed all the memory given refused before it is searched or built."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hostile_support import refused

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-llama"
MEMORIES = ["--gpu-mem", "8GB", "--cpu-mem", "8GB"]


def _folder(tmp_path: Path, **edits: Any) -> Path:
    cfg = json.loads((TINY / "config.json").read_text())
    cfg.update(edits)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda p: os.mkfifo(p), "is a FIFO"),
        (lambda p: p.symlink_to("/dev/zero"), "is a character device"),
        (lambda p: p.mkdir(), "is a directory"),
    ],
    ids=["fifo", "dev-zero-link", "folder"],
)
def test_a_config_json_that_is_no_regular_file_is_named_as_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, kind: str
) -> None:
    d = tmp_path / "m"
    d.mkdir()
    make(d / "config.json")
    for argv in (
        ["plan", "--model", str(d)],
        ["finetune", "--model", str(d), "--config", "x", "--data", "y"],
    ):
        err = refused(capsys, argv)
        assert f"--model {d}: its config.json {kind}, not a regular file" in err


def test_a_model_path_that_is_a_fifo_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "config.json")
    assert "is a FIFO" in refused(capsys, ["plan", "--model", str(tmp_path / "config.json")])


def test_a_config_json_linked_to_a_blob_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Hugging Face cache links each file of a snapshot to a blob: links are followed."""
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    blob.write_text((TINY / "config.json").read_text())
    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "config.json").symlink_to(blob)
    from tiered.planning.model_shape import shape_from_model

    assert shape_from_model(snap).total_params == shape_from_model(TINY).total_params


def test_an_oversized_or_deeply_nested_config_json_is_refused_before_parsing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "m"
    d.mkdir()
    with open(d / "config.json", "wb") as f:
        f.truncate(1 << 30)  # sparse: nothing is written, and nothing may be read
    assert "1,073,741,824 bytes or more" in refused(capsys, ["plan", "--model", str(d)])
    (d / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = refused(capsys, ["plan", "--model", str(d)])
    assert f"--model {d / 'config.json'}: nests objects or lists deeper" in err


@pytest.mark.parametrize(
    "edits, said",
    [
        ({"num_attention_heads": 0}, "num_attention_heads is 0; a size is a whole number >= 1"),
        ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1,000,000,000, more than 10,000 layers"),
        ({"num_hidden_layers": 1e9}, "num_hidden_layers is 1000000000.0 (float)"),
        ({"hidden_size": "big"}, "hidden_size is 'big' (str)"),
        ({"hidden_size": True}, "hidden_size is True (bool)"),
        ({"hidden_size": -192}, "hidden_size is -192"),
        ({"hidden_size": 2**40}, "more than any machine holds"),
        ({"vocab_size": 0}, "vocab_size is 0"),
        ({"intermediate_size": 0}, "intermediate_size is 0"),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads (4) is not a whole multiple of num_key_value_heads (3)",
        ),
        (
            {"num_attention_heads": 256, "num_key_value_heads": 256},
            "num_attention_heads (256) is more than hidden_size (192)",
        ),
        ({"rope_theta": "fast"}, "rope_theta is 'fast'"),
        ({"model_type": 5}, "model_type is 5"),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v)[:40] if isinstance(v, dict) else None,
)
def test_an_implausible_size_is_refused_naming_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edits: dict[str, Any], said: str
) -> None:
    d = _folder(tmp_path, **edits)
    err = refused(capsys, ["plan", "--model", str(d), *MEMORIES])
    assert f"--model {d / 'config.json'}: " in err and said in err


def test_a_gpt2_size_is_named_as_the_file_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "g"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 0, "n_layer": 2, "vocab_size": 256})
    )
    assert "n_head is 0" in refused(capsys, ["plan", "--model", str(d)])


def test_transformers_own_validation_is_named_with_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _folder(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = None
    cfg["use_cache"] = "no"
    (d / "config.json").write_text(json.dumps(cfg))
    err = refused(capsys, ["plan", "--model", str(d)])
    assert f"--model {d / 'config.json'}: transformers" in err and "refuses this llama config" in err
    assert "num_hidden_layers" in err or "use_cache" in err


def test_sizes_are_checked_before_the_finetune_builds_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _folder(tmp_path, num_hidden_layers=10**9)
    err = refused(capsys, ["finetune", "--model", str(d), "--config", str(ROOT / "examples" / "ds_config.json"),
                            "--data", str(ROOT / "examples" / "corpus.txt")])  # fmt: skip
    assert "num_hidden_layers is 1,000,000,000" in err


def test_weights_larger_than_all_the_memory_given_are_refused_before_the_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _folder(tmp_path, vocab_size=10**12)
    err = refused(capsys, ["plan", "--model", str(d), *MEMORIES, "--nvme-mem", "1TB"])
    assert "parameters need 768.00 TB for their weights alone" in err and "--nvme-mem" in err


def test_a_model_larger_than_the_host_is_refused_before_it_is_built_there(tmp_path: Path) -> None:
    """No weights in the folder: tiered finetune builds the model in host memory, in fp32. Run in
    a process limited to 6 GiB of address space, so that a regression meets MemoryError there
    instead of this machine's OOM killer."""
    import resource
    import subprocess
    import sys

    d = _folder(
        tmp_path,
        hidden_size=65536,
        intermediate_size=131072,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=64,
    )
    cfg = tmp_path / "ds.json"
    cfg.write_text(
        json.dumps(
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
        )
    )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")]),
    )
    argv = [
        "finetune",
        "--model",
        str(d),
        "--config",
        str(cfg),
        "--data",
        str(ROOT / "examples" / "corpus.txt"),
    ]
    r = subprocess.run(
        [sys.executable, "-m", "tiered.cli.main", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "for their weights alone (4 B each)" in r.stderr and "this machine's memory" in r.stderr
