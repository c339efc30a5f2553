"""`tiered plan`'s bad input is named: the file, the flag, the contradiction."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered.cli.main import main

pytest.importorskip("transformers")


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_bandwidth_file_not_the_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bw.json"
    f.write_text('{"gbps": 3}')
    assert 'not tiered bench\'s JSON (no "methods" list' in _err(
        capsys, ["plan", "--params", "100M", "--bandwidth", str(f)]
    )
    f.write_text("not json")
    assert f"--bandwidth {f}: not a JSON file" in _err(
        capsys, ["plan", "--params", "100M", "--bandwidth", str(f)]
    )


def test_contradictory_pinned_knobs_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = _err(capsys, ["plan", "--params", "100M", "--offload-optimizer", "none", "--grad-tier", "nvme"])
    assert "contradictory pinned knobs" in err and "--grad-tier nvme" in err


def test_model_folder_without_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "folder has no config.json" in _err(capsys, ["plan", "--model", str(tmp_path)])


def test_memories_too_small_name_the_closest_config_and_each_shortfall(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["plan", "--params", "100M", "--gpu-mem", "64MiB", "--cpu-mem", "256MiB", "--nvme-mem", "100MB"]
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "nothing fits. closest:" in out and "short by" in out
    assert "nvme_path" in out or "offload" in out  # each shortfall with the key that fixes it


def test_unknown_model_type_is_named_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "xyz_unknown", "hidden_size": 64}')
    err = _err(capsys, ["plan", "--model", str(tmp_path)])
    assert "unknown or invalid model_type 'xyz_unknown'" in err and "does not know it" in err
    assert len(err) < 500, "transformers' list of every model type it knows was passed on"


def test_a_config_whose_layer_cannot_run_is_an_error_naming_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaConfig

    import tiered.planning.compute_probe as compute_probe

    # A layer that fails when it runs (what 16 key/value heads for 4 query heads did before
    # config.json's sizes were checked on reading, test_kv_heads_that_do_not_divide_are_refused_by_key):
    # the probe's own failure, injected, is what the command must name.
    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("shape '[1, 16, 16, 16]' is invalid for input of size 1024")

    monkeypatch.setattr(compute_probe, "probe_model_compute", fails)
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, bos_token_id=1, eos_token_id=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    err = _err(
        capsys, ["plan", "--model", str(tmp_path), "--seq-len", "16", "--device", "cpu", "--cpu-mem", "2GiB"]
    )
    assert f"--model {tmp_path}: one layer of the model" in err and "fails to run" in err
    assert "Traceback" not in err


def test_kv_heads_that_do_not_divide_are_refused_by_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import LlamaConfig

    # 16 key/value heads for 4 query heads: built on the meta device, it failed only when a layer ran
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=16, vocab_size=100, bos_token_id=1, eos_token_id=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    err = _err(capsys, ["plan", "--model", str(tmp_path), "--cpu-mem", "2GiB"])
    assert f"--model {tmp_path / 'config.json'}: num_attention_heads (4) is not a whole multiple of" in err
    assert "num_key_value_heads (16)" in err and "Traceback" not in err


def test_a_config_naming_its_own_code_is_built_as_transformers_class_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    from tiered.planning.hf_config import load_hf_config, resolve_model

    config = {
        "model_type": "llama", "architectures": ["MyLlama"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
        "auto_map": {"AutoModelForCausalLM": "modeling_my.MyLlama"},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="tiered.planning.hf_config"):
        load_hf_config(resolve_model(tmp_path))
    assert "modeling_my.MyLlama" in caplog.text and "never runs a model folder's code" in caplog.text
