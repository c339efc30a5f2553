"""issue 36: the families people fine-tune, as transformers 5 saves them, through tiered.

For each family a tiny model (2 layers, hidden 32, 4 experts where it has experts) is initialised
by transformers and written by its own ``save_pretrained`` (sharded, with an index: one tensor
per expert where the family's files have them), then:

- plan: ``tiered plan --model DIR`` reads it (0/1: a verdict; 2: refused);
- trains (cpu, nvme): ``tiered.from_pretrained`` with parameters and optimizer state in cpu, and
  on NVMe files; its first loss against transformers' own forward of the folder, and 5 AdamW
  steps against plain ``torch.optim.AdamW`` (max |difference| over every parameter);
- LoRA: peft's adapters on the attention and, where the experts are fused tensors, on them
  (``target_parameters``), 3 steps against peft + torch; the merge after close against peft's;
- export: ``engine.save_pretrained`` loaded back by transformers (no missing, unexpected or
  mismatched key; the same file names as the folder's), its logits against the trained engine's;
- resume: 2 steps, a checkpoint, 2 more, against a fresh engine resumed from it (bitwise).

    python benchmarks/families.py [--families mixtral qwen3_moe ...] [--json out.json]

fp32 throughout; a wrapped (multimodal) family trains its language model, the other towers
frozen, in the reference too.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from moe_support import (
    ATTENTION_TARGETS,
    FAMILIES,
    batches,
    reference,
    saved_keys,
    tiered_steps,
    torch_adamw,
    write_folder,
)

import tiered

DENSE: dict[str, Any] = {}


def _dense() -> dict[str, Any]:
    import transformers as t

    c = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return {
        "llama": lambda: t.LlamaConfig(**c),
        "mistral": lambda: t.MistralConfig(**c),
        "qwen2": lambda: t.Qwen2Config(**c),
        "qwen3": lambda: t.Qwen3Config(**c, head_dim=8),
        "gemma": lambda: t.GemmaConfig(**c, head_dim=8),
        "gemma2": lambda: t.Gemma2Config(**c, head_dim=8),
        "phi3": lambda: t.Phi3Config(**c, pad_token_id=0),
        "gpt_neox": lambda: t.GPTNeoXConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        ),
    }


def _cfg(tmp: Path, param: str, opt: str) -> dict[str, Any]:
    from engine_support import ds_config

    return ds_config(
        param=param, opt=opt, nvme_path=str(tmp / f"nvme-{param}-{opt}"), lr=1e-2, sub_group_size=4000
    )


def _maxdiff(a: dict[str, torch.Tensor], b: Any) -> float:
    return max(float((a[n] - p.detach()).abs().max()) for n, p in b.named_parameters())


def _folder(tmp: Path, family: str) -> Path:
    if family in FAMILIES:
        return write_folder(tmp / family, family)
    return write_folder(tmp / family, family, config=DENSE[family]())


def check(family: str, tmp: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from tiered.cli.main import main

    row: dict[str, Any] = {"family": family}
    folder = _folder(tmp, family)
    row["plan"] = main(["plan", "--model", str(folder), "--gpu-mem", "1GB", "--cpu-mem", "4GB", "--json"])
    data = batches(5)
    ref = reference(folder)
    want = torch_adamw(ref, data)
    for param, opt in (("cpu", "cpu"), ("nvme", "nvme")):
        with tiered.from_pretrained(folder, _cfg(tmp, param, opt)) as engine:
            got = tiered_steps(engine, data)
            trained = engine.zero.gather_full_state_dict()
            if param == "cpu":
                probe = batches(1, seed=9)[0]["input_ids"]
                logits = engine(input_ids=probe).logits.detach().clone()
                engine.save_pretrained(tmp / f"{family}-out", dtype=torch.float32, max_shard_size="24KB")
        row[f"first_loss_rel_{param}"] = abs(got[0] - want[0]) / abs(want[0])
        row[f"losses_rel_{param}"] = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
        row[f"params_maxdiff_{param}"] = _maxdiff(trained, ref)
    back, info = AutoModelForCausalLM.from_pretrained(
        tmp / f"{family}-out", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    row["export_gaps"] = sum(len(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    row["export_logits_maxdiff"] = float((back(input_ids=probe).logits - logits).abs().max())
    row["export_same_names"] = saved_keys(tmp / f"{family}-out") == saved_keys(folder)
    row.update(_lora(folder, family))
    row["resume_bitwise"] = _resume(folder, tmp)
    return row


def _lora(folder: Path, family: str) -> dict[str, Any]:
    from tiered.finetune.lora import LoraSpec, apply_lora, fused_parameter_names

    base = reference(folder)
    targets: tuple[str, ...] = ATTENTION_TARGETS.get(family, ("q_proj", "v_proj"))
    targets = {"gpt_neox": ("query_key_value",), "phi3": ("qkv_proj",)}.get(family, targets)
    experts = [n for n in fused_parameter_names(base) if n.startswith("experts.") and n.count(".") == 1]
    targets = (*targets, *experts)
    torch.manual_seed(1)
    ref = apply_lora(base, LoraSpec(r=4, alpha=8, targets=targets))
    for n, p in ref.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    model = copy.deepcopy(ref)
    data = batches(3)
    want = torch_adamw(ref, data)
    with tempfile.TemporaryDirectory() as d:
        engine = tiered.initialize(model, _cfg(Path(d), "cpu", "cpu"))
        got = tiered_steps(engine, data)
        engine.close()
    merged = model.merge_and_unload().state_dict()
    diff = max(float((merged[k] - v).abs().max()) for k, v in ref.merge_and_unload().state_dict().items())
    return {
        "lora_targets": ",".join(targets),
        "lora_losses_rel": max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)),
        "lora_merged_maxdiff": diff,
    }


def _resume(folder: Path, tmp: Path) -> bool:
    data = batches(4)

    def state(engine: Any) -> dict[str, torch.Tensor]:
        return engine.zero.gather_full_state_dict()

    with tiered.from_pretrained(folder, _cfg(tmp, "nvme", "cpu")) as engine:
        tiered_steps(engine, data[:2])
        engine.save_checkpoint(tmp / "ckpt")
        tail = tiered_steps(engine, data[2:])
        want = state(engine)
    with tiered.from_pretrained(folder, _cfg(tmp, "nvme", "cpu")) as engine:
        engine.load_checkpoint(tmp / "ckpt")
        ok = tiered_steps(engine, data[2:]) == tail
        got = state(engine)
    return ok and all(torch.equal(got[k], v) for k, v in want.items())


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| family | plan | trains (cpu, nvme) | first loss = transformers (rel) | 5 steps = torch AdamW "
        "(max param diff cpu / nvme) | LoRA (loss rel, merged max diff; targets) | export loads and equals "
        "(gaps, logits max diff, same names) | resume bitwise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | FAILED: {r['error']} |")
            continue
        trains = "yes, yes" if max(r["losses_rel_cpu"], r["losses_rel_nvme"]) <= 1e-5 else "NO"
        out.append(
            f"| {r['family']} | {'ok' if r['plan'] in (0, 1) else 'refused'} | {trains} | "
            f"{max(r['first_loss_rel_cpu'], r['first_loss_rel_nvme']):.1e} | "
            f"{r['params_maxdiff_cpu']:.1e} / {r['params_maxdiff_nvme']:.1e} | "
            f"{r['lora_losses_rel']:.1e}, {r['lora_merged_maxdiff']:.1e}; {r['lora_targets']} | "
            f"{r['export_gaps']}, {r['export_logits_maxdiff']:.1e}, {'yes' if r['export_same_names'] else 'NO'} | "
            f"{'yes' if r['resume_bitwise'] else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    DENSE.update(_dense())
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=[*FAMILIES, *DENSE])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for family in a.families:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            try:
                row = check(family, Path(d))
            except Exception as exc:  # noqa: BLE001 - reported in the table, the others still run
                row = {"family": family, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print(table(rows))
    return (
        0
        if all("error" not in r for r in rows)
        and all(not math.isnan(r.get("losses_rel_cpu", 0)) for r in rows)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
