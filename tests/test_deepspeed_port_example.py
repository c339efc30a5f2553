"""examples/deepspeed_port.py, a DeepSpeed script ported by one import, trains and exports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deepspeed_port.py"


def test_the_ported_script_trains_and_exports(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("deepspeed_port", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(mod.DEFAULT_CONFIG))
    out = tmp_path / "out"
    losses = mod.main(
        ["--deepspeed_config", str(cfg), "--steps", "4", "--seq-len", "16", "--lr", "1e-2", "--out", str(out)]
    )
    assert len(losses) == 8  # 4 steps x gradient_accumulation_steps 2
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    assert (out / "checkpoints" / "latest").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "model"))
    assert model.config.hidden_size == 192
