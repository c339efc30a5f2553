"""The MoE and wrapped families as transformers 5 saves them, through tiered: per-expert files
streamed into the fused parameters ([Note: file tensors by transformers' conversions]), training
equal to plain PyTorch AdamW, the export loading back in transformers, LoRA (attention and fused
experts) equal to peft's, and a bitwise resume. One tiny sharded folder per family, written by
the family's own ``save_pretrained``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from moe_support import (
    ATTENTION_TARGETS,
    FAMILIES,
    PER_EXPERT,
    batches,
    clone,
    config,
    file_keys,
    reference,
    saved_keys,
    tiered_steps,
    torch_adamw,
    write_folder,
)

import tiered

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 5


def _train_and_export(tmp_path, family: str, *, param: str, opt: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_folder(tmp_path / family, family)
    keys = file_keys(folder)
    assert len(set(keys.values())) > 1  # sharded, through the index
    if family in PER_EXPERT:  # the layout this is about: one tensor per expert in the files
        assert any(".experts.3." in k for k in keys), sorted(keys)[:8]
    ref = reference(folder)
    data = batches(STEPS)
    want = torch_adamw(ref, data)
    with tiered.from_pretrained(folder, config(tmp_path, param=param, opt=opt)) as engine:
        got = tiered_steps(engine, data)
        trained = engine.zero.gather_full_state_dict()
        probe = batches(1, seed=9)[0]
        logits = engine(input_ids=probe["input_ids"]).logits.detach().clone()
        engine.save_pretrained(tmp_path / "out", dtype=torch.float32, max_shard_size="24KB")
    assert got[0] == pytest.approx(want[0], rel=1e-6)  # the first loss is transformers' own forward
    assert got == pytest.approx(want, rel=1e-5)
    for name, p in ref.named_parameters():
        # the house standard, fp32 to 1e-5 per parameter: a Qwen key bias, whose gradient is a sum that
        # nearly cancels, differs by ~5e-6 after 5 steps at lr 1e-2 (the leaf's boundary sums in another order)
        torch.testing.assert_close(
            trained[name], p.detach(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the export has the files transformers writes (per-expert names) and loads without a gap
    assert saved_keys(tmp_path / "out") == saved_keys(folder)
    back, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(back) is type(ref)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    torch.testing.assert_close(back(input_ids=probe["input_ids"]).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_as_torch_and_exports_as_transformers(tmp_path, family):
    """First loss = transformers' forward, 5 AdamW steps = torch's, and the export loads in
    transformers (same file names, no missing or unexpected key) with the trained logits."""
    _train_and_export(tmp_path, family, param="cpu", opt="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_from_nvme(tmp_path, family):
    """The same with parameters and optimizer state on NVMe files."""
    _train_and_export(tmp_path, family, param="nvme", opt="nvme")


_SLOW = pytest.mark.slow  # the default suite keeps one per-expert MoE, the fused-file one and the wrapper
LORA_FAMILIES = [
    "mixtral",
    pytest.param("qwen2_moe", marks=_SLOW),
    pytest.param("qwen3_moe", marks=_SLOW),
    pytest.param("deepseek_v3", marks=_SLOW),
    pytest.param("olmoe", marks=_SLOW),
    "gpt_oss",
    "gemma3",
]


@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_lora_on_attention_and_fused_experts_equals_peft(tmp_path, family):
    """peft's LoRA on the attention and, where the family fuses its experts, on the fused
    expert parameters (peft's target_parameters): three steps equal peft + torch AdamW, and the
    adapters merged after close equal peft's merge of the reference."""
    import peft

    from tiered.finetune.lora import LoraSpec, apply_lora

    folder = write_folder(tmp_path / family, family)
    targets = ATTENTION_TARGETS.get(family, ("q_proj", "v_proj"))
    if family != "gemma3":
        targets = (*targets, "experts.gate_up_proj", "experts.down_proj")
    torch.manual_seed(1)
    ref = apply_lora(reference(folder), LoraSpec(r=4, alpha=8, targets=targets))
    for n, p in ref.named_parameters():  # peft starts lora_B at zero: make the adapters matter
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    model = clone(ref)
    assert isinstance(model, peft.PeftModel)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if family == "gemma3":  # the language model's attention only, not the vision tower's q_proj / v_proj
        assert trained and all(".language_model." in n for n in trained), trained
    else:
        assert any(".experts." in n for n in trained), trained
    data = batches(3)
    want = torch_adamw(ref, data)
    engine = tiered.initialize(model, config(tmp_path))
    got = tiered_steps(engine, data)
    engine.close()  # the module holds its trained weights again
    assert got == pytest.approx(want, rel=1e-5)
    merged = model.merge_and_unload().state_dict()
    for name, v in ref.merge_and_unload().state_dict().items():
        torch.testing.assert_close(merged[name], v, rtol=1e-5, atol=1e-6, msg=name)


def _resume(tmp_path, family: str) -> None:
    from checkpoint_support import assert_bitwise_equal, full_state

    folder = write_folder(tmp_path / family, family)
    data = batches(4)
    cfg = config(tmp_path, param="nvme", opt="cpu")
    with tiered.from_pretrained(folder, cfg) as engine:
        tiered_steps(engine, data[:2])
        engine.save_checkpoint(tmp_path / "ckpt")
        tiered_steps(engine, data[2:])
        want = full_state(engine)
    with tiered.from_pretrained(folder, config(tmp_path, param="nvme", opt="cpu")) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        tiered_steps(engine, data[2:])
        assert_bitwise_equal(full_state(engine), want)


def test_resume_of_a_streamed_moe_is_bitwise(tmp_path):
    """Two steps, a checkpoint, two more: resumed in a fresh engine (the files streamed again),
    the two more steps end bitwise where the uninterrupted run did."""
    _resume(tmp_path, "qwen3_moe")


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"])
def test_resume_is_bitwise_in_every_family(tmp_path, family):
    _resume(tmp_path, family)
