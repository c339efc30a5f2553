"""Fused expert parameters planned in pieces of whole experts ([Note: fused parameters in pieces]
in tiered/zero/split.py): every group bounded by the cap, training and checkpoints as with the
parameter whole, the whole buffer written back by gathered_parameters, DeepSpeed's safe getters
over the pieces, and two ranks whose tokens reach different experts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from moe_support import (
    batches,
    config,
    hf_config,
    reference,
    tiered_steps,
    torch_adamw,
    write_folder,
)

import tiered

pytestmark = pytest.mark.usefixtures("one_thread")

FUSED = "model.layers.1.mlp.experts.gate_up_proj"  # [4, 32, 32] in qwen3_moe: 1,024 per expert


def test_a_fused_tensor_above_the_cap_is_planned_in_pieces_of_whole_experts():
    from transformers import AutoModelForCausalLM

    from tiered.config.loader import load_config
    from tiered.zero.layout import plan_layout

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf_config("mixtral")
        )  # gate_up [4, 64, 32]: 2,048 per expert
    cap = 5000
    z = load_config({"zero_optimization": {"stage": 3, "sub_group_size": cap}}).zero
    layout = plan_layout(
        model,
        z,
        gpu_budget_bytes=None,
        compute_dtype=torch.float32,
        world_size=1,
        param_tier="cpu",
        grad_tier="cpu",
    )
    name = "model.layers.0.mlp.experts.gate_up_proj"
    pieces = [(pg.numel, a, n) for pg in layout.planned for q, _, a, n in pg.slots() if q == name]
    assert [(a, n) for _, a, n in pieces] == [(0, 4096), (4096, 4096)]  # two experts each, in order
    assert all(numel <= cap for numel, _, _ in pieces)
    assert max(pg.numel for pg in layout.planned) <= 8192  # the embedding (64 x 32 = 2,048) whole
    whole = [pg for pg in layout.planned for q, *_ in pg.slots() if q == "model.embed_tokens.weight"]
    assert len(whole) == 1
    # the leaf (the MoE block) gathers every piece, and the whole buffer is counted at init
    assert layout.gpu_need.gather_bytes >= 2 * 4 * 64 * 32 * 4


def _pieces_in(engine: Any) -> set[str]:
    return {e.name for g in engine.zero.groups for e in g.entries if e.is_piece}


def test_training_in_pieces_equals_torch_and_resumes_into_another_tiling(tmp_path: Path) -> None:
    """Five steps in pieces equal plain PyTorch AdamW; a checkpoint saved in pieces loads into a
    run that keeps the tensors whole (another sub_group_size) and continues bit for bit as the
    run in pieces does."""
    folder = write_folder(tmp_path / "qwen3", "qwen3_moe")
    data = batches(5)
    want = torch_adamw(reference(folder), data)
    small = config(tmp_path, param="nvme", opt="cpu", sub_group_size=2500)
    with tiered.from_pretrained(folder, small) as engine:
        assert FUSED in _pieces_in(engine)
        got = tiered_steps(engine, data[:3])
        engine.save_checkpoint(tmp_path / "ckpt")
        saved = engine.zero.gather_full_state_dict()
        got += tiered_steps(engine, data[3:])
        tiled = engine.zero.gather_full_state_dict()
    assert got == pytest.approx(want, rel=1e-5)
    from tiered.checkpoint import read_parameters

    whole = read_parameters(tmp_path / "ckpt", kind="param")  # without an engine: the pieces put together
    assert torch.equal(whole[FUSED], saved[FUSED])
    big = config(tmp_path, param="nvme", opt="cpu", sub_group_size=100_000)
    with tiered.from_pretrained(folder, big) as engine:
        assert not _pieces_in(engine)
        engine.load_checkpoint(tmp_path / "ckpt")
        assert tiered_steps(engine, data[3:]) == got[3:]
        for k, v in engine.zero.gather_full_state_dict().items():
            assert torch.equal(v, tiled[k]), k


def test_gathered_parameters_and_safe_getters_see_the_whole_parameter(tmp_path: Path) -> None:
    from tiered.deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    folder = write_folder(tmp_path / "qwen3", "qwen3_moe")
    with tiered.from_pretrained(folder, config(tmp_path, sub_group_size=2500)) as engine:
        assert FUSED in _pieces_in(engine)
        p = engine.module.get_parameter(FUSED)
        before = safe_get_full_fp32_param(p)
        assert before is not None and tuple(before.shape) == (4, 32, 32)
        with engine.gathered_parameters(p, modify=True):
            torch.testing.assert_close(p.detach(), before)
            p.data[3].fill_(0.5)  # the last expert: in the last piece
            p.data[0, 0, 0] = -1.0  # the first: in the first
        after = engine.zero.gather_full_state_dict()[FUSED]
        assert float(after[3].min()) == float(after[3].max()) == 0.5 and float(after[0, 0, 0]) == -1.0
        torch.testing.assert_close(after[1:3], before[1:3])
        master = safe_get_full_fp32_param(p)
        assert master is not None and torch.equal(master, after)  # the fp32 master followed
        value = torch.arange(math.prod(before.shape), dtype=torch.float32).reshape(before.shape) / 1e4
        safe_set_full_fp32_param(p, value)
        assert torch.equal(engine.zero.gather_full_state_dict()[FUSED], value)
        loss = engine(**batches(1)[0]).loss  # and the model trains on from there
        engine.backward(loss)
        engine.step()


def test_an_expert_no_token_reaches_is_stepped_as_torch_steps_it(tmp_path: Path) -> None:
    """The no-grad rule for fused experts: a step where some expert of a layer gets no token still
    gives its fused tensor a gradient (zeros in that expert's rows, as autograd gives them), so
    plain AdamW decays and moves those rows too; tiered does the same, whole tensor or in pieces."""
    folder = write_folder(tmp_path / "qwen3", "qwen3_moe")
    data = _rank_batches()[0]
    ref = reference(folder)
    reached = _experts_reached(ref, data[0])
    assert any(len(r) < 4 for r in reached), reached  # some expert of some layer is idle
    want = torch_adamw(ref, data)
    with tiered.from_pretrained(folder, config(tmp_path, sub_group_size=2500)) as engine:
        assert FUSED in _pieces_in(engine)
        assert tiered_steps(engine, data) == pytest.approx(want, rel=1e-5)
        got = engine.zero.gather_full_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-5, msg=n)


RANKS_DATA = 2


def _rank_train(rank: int, folder: str, nvme: str) -> dict[str, Any]:
    from moe_support import config as cfg_of

    data = _rank_batches()[rank]
    cfg = cfg_of(Path(nvme), param="cpu", opt="cpu", sub_group_size=2500)
    with tiered.from_pretrained(folder, cfg) as engine:
        losses = tiered_steps(engine, data)
        return {
            "losses": losses,
            "state": engine.zero.gather_full_state_dict(),
            "leaves": engine.stats()["zero"]["leaf_modules"],
            "pieces": sorted(_pieces_in(engine)),
        }


def _rank_batches() -> list[list[dict[str, torch.Tensor]]]:
    """Three tokens a rank: few enough that the ranks' tokens reach different experts."""
    return [[{k: v[:1, :3] for k, v in b.items()} for b in batches(3, seed=s)] for s in (11, 12)]


def _experts_reached(model: Any, batch: dict[str, torch.Tensor]) -> list[list[int]]:
    hit: list[list[int]] = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: hit.append(sorted(set(args[1].flatten().tolist()))))
        for m in model.modules()
        if type(m).__name__.endswith("Experts")
    ]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    return hit


@pytest.mark.slow
def test_two_ranks_whose_tokens_reach_different_experts_train_as_ddp(tmp_path: Path) -> None:
    """Each rank streams its shard of a per-expert folder into pieces; the MoE blocks are leaves
    by default, so the ranks' different routing neither hangs nor mismatches a collective, and
    training equals plain PyTorch with the ranks' gradients averaged."""
    from leaf_support import run_ranks

    folder = write_folder(tmp_path / "qwen3", "qwen3_moe")
    data = _rank_batches()
    ref = reference(folder)
    assert _experts_reached(ref, data[0][0]) != _experts_reached(ref, data[1][0])  # else this proves nothing
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    want: list[list[float]] = [[], []]
    for i in range(len(data[0])):
        for r in range(RANKS_DATA):
            loss = ref(**data[r][i]).loss
            want[r].append(float(loss.detach()))
            (loss / RANKS_DATA).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ranks = run_ranks(_rank_train, tmp_path, str(folder), str(tmp_path / "nvme"), timeout_s=300)
    for r, got in enumerate(ranks):
        assert "error" not in got, got.get("error")
        assert got["leaves"] == 2 and FUSED in got["pieces"]
        assert got["losses"] == pytest.approx(want[r], rel=1e-5)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got["state"][n], p.detach(), rtol=1e-5, atol=1e-5, msg=n)


_RSS_SCRIPT = r"""
import json, os, sys
import torch, transformers
sys.path.insert(0, "tests")
from engine_support import ds_config
import tiered

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

folder, nvme, sgs, cpu_b, gpu_b = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
with torch.device("meta"):  # transformers' modules imported before the baseline
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
cfg = ds_config(param="nvme", opt="nvme", nvme_path=nvme, sub_group_size=sgs, gpu_budget=gpu_b, cpu_budget=cpu_b,
                dtype="bf16", buffer_count=2)
cfg["tiered"]["grad_tier"] = "nvme"
base = status("VmRSS")
with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
try:
    engine = tiered.from_pretrained(folder, cfg)
except tiered.CapacityError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
peak = status("VmHWM") - base
ids = torch.randint(0, 256, (1, 8))
loss = float(engine(input_ids=ids, labels=ids).loss)
engine.close()
print(json.dumps({"peak_load": peak, "loss": loss}))
"""


@pytest.mark.slow
def test_streaming_a_per_expert_folder_never_holds_a_fused_tensor(tmp_path: Path) -> None:
    """A Mixtral layer of 64 experts (gate_up_proj 33.5M elements: 134 MB in fp32) from per-expert
    bf16 files, parameters and optimizer state on NVMe, one expert per piece: the peak RSS of
    `tiered.from_pretrained` (the streamed load and the optimizer's fp32 masters read again) stays
    below the fused tensor, within the tiers' budgets plus the streaming buffers of one piece. With
    the tensor kept whole the same budgets cannot even hold its group: refused before any write."""
    import json
    import subprocess
    import sys

    from transformers import MixtralConfig

    from tiered.testing.weights import write_random_weights
    from tiered.zero.load import CHUNK_BYTES

    hf = MixtralConfig(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=64, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    folder = tmp_path / "mixtral"
    write_random_weights(folder, hf, dtype=torch.bfloat16, shard_bytes=32 << 20)
    assert (folder / "model.safetensors.index.json").is_file()
    fused = 64 * 2048 * 256 * 4  # gate_up_proj in fp32
    expert = 2048 * 256
    cpu_b, gpu_b = 32 << 20, 256 << 20

    def run(sgs: int, nvme: str) -> dict[str, Any]:
        root = Path(__file__).resolve().parents[1]
        args = [str(folder), str(tmp_path / nvme), str(sgs), str(cpu_b), str(gpu_b)]
        res = subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, *args], capture_output=True, text=True, timeout=900, cwd=root
        )
        assert res.returncode == 0, res.stderr[-3000:]
        return dict(json.loads(res.stdout.strip().splitlines()[-1]))

    got = run(expert + 1000, "nvme-pieces")  # one expert per piece
    streaming = expert * 4 * 2 + CHUNK_BYTES  # one piece's fp32 shard, its bf16 copy, one chunk
    assert got["peak_load"] < fused, got
    assert got["peak_load"] < cpu_b + streaming + (64 << 20), got
    assert math.isfinite(got["loss"])
    whole = run(fused, "nvme-whole")
    assert "refused" in whole and "cpu budget" in whole["refused"], whole
