"""engine.save_pretrained writes the tokenizer when it knows it ([Note: tokenizer files in the
export]): the files of the folder the weights came from, a tokenizer object's own files, or
none; the export loads with AutoTokenizer and AutoModelForCausalLM, weights identical. A peft
model exports its adapter ([Note: exporting a peft model])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from finetune_support import ds_config, write_model

import tiered
from tiered.checkpoint.export import TOKENIZER_FILES
from tiered.errors import ConfigError
from tiered.finetune import build_model, resolve_model

pytest.importorskip("transformers")

GENERATION = {"eos_token_id": [256, 261], "do_sample": True, "temperature": 0.7, "top_p": 0.9}


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """A tiny Llama folder as the Hub ships one: weights, tokenizer, generation config and an
    extra chat template."""
    src = write_model(tmp_path / "m")
    build_model(resolve_model(src), seed=3).save_pretrained(src)
    (src / "generation_config.json").write_text(json.dumps(GENERATION))
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "plain.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    return src


def _trained(folder: Path, tmp_path: Path) -> tiered.Engine:
    engine = tiered.from_pretrained(folder, ds_config(tmp_path / "nvme", param="cpu", opt="cpu"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    return engine


def test_export_copies_the_tokenizer_of_the_weights_folder(folder: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "hf"
    with _trained(folder, tmp_path) as engine:
        assert engine.tokenizer_source == str(folder)
        want = {k: v.clone() for k, v in engine.state_dict_fp32().items()}
        engine.save_pretrained(out, dtype=torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "additional_chat_templates/plain.jinja"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    tok, src = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(folder))
    text = "the fast place is small."
    assert tok.eos_token == "</s>" and tok(text)["input_ids"] == src(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == src.chat_template
    assert tok.apply_chat_template(chat, chat_template="plain", tokenize=False) == "hi"
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    got = dict(loaded.named_parameters())
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k].detach(), v), k
    # the folder's generation config (stop tokens, sampling) travels with the model
    gen = GenerationConfig.from_pretrained(str(out))
    assert gen.eos_token_id == [256, 261] and gen.temperature == 0.7 and gen.do_sample


def test_a_tokenizer_object_none_or_a_bad_argument(folder: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = AutoTokenizer.from_pretrained(str(folder))
    with _trained(folder, tmp_path) as engine:
        engine.save_pretrained(tmp_path / "obj", tokenizer=src)
        engine.save_pretrained(tmp_path / "none", tokenizer=False)
        with pytest.raises(TypeError, match=r"has no save_pretrained\(dir\)"):
            engine.save_pretrained(tmp_path / "bad", tokenizer=object())
        with pytest.raises(ConfigError, match=r"tokenizer='.*nope'\): no such folder"):
            engine.save_pretrained(tmp_path / "bad", tokenizer=tmp_path / "nope")
    assert not (tmp_path / "bad").exists()  # refused before anything was written
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "obj"))
    assert tok("small")["input_ids"] == src("small")["input_ids"] and tok.eos_token == "</s>"
    assert not [n for n in TOKENIZER_FILES if (tmp_path / "none" / n).exists()]
    assert (tmp_path / "none" / "model.safetensors").is_file()


def test_a_model_without_weights_folder_exports_no_tokenizer_unless_given(tmp_path: Path) -> None:
    src = write_model(tmp_path / "m")
    model = build_model(resolve_model(src), seed=3)
    with tiered.initialize(model, ds_config(tmp_path / "nvme", param="cpu", opt="cpu")) as engine:
        assert engine.tokenizer_source is None
        engine.save_pretrained(tmp_path / "plain")
        engine.save_pretrained(tmp_path / "given", tokenizer=src)
    assert not [n for n in TOKENIZER_FILES if (tmp_path / "plain" / n).exists()]
    assert (tmp_path / "given" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_a_peft_model_exports_its_adapter_in_peft_format(folder: Path, tmp_path: Path) -> None:
    """[Note: exporting a peft model]: not peft's names as a transformers checkpoint (which
    from_pretrained would load as random weights), but the adapter PeftModel loads."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_model(resolve_model(folder), seed=0)  # the folder's weights
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    out = tmp_path / "adapter"
    counts = model.get_nb_trainable_parameters()  # (trainable, all)
    with tiered.initialize(model, ds_config(tmp_path / "nvme", param="cpu", opt="cpu")) as engine:
        assert sum(p.numel() for p in model.parameters()) == 0  # released, as under DeepSpeed
        assert model.get_nb_trainable_parameters() == counts  # through ds_numel
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        want = {k: v.clone() for k, v in engine.state_dict_fp32().items() if "lora_" in k}
        engine.save_pretrained(out, dtype=torch.float32, tokenizer=folder)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists() and (out / "tokenizer.json").is_file()
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    assert AutoTokenizer.from_pretrained(str(out)).eos_token == "</s>"
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(folder)), str(out))
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(got) == len(want) and any(float(v.abs().sum()) > 0 for k, v in want.items() if "lora_B" in k)
    for k, v in want.items():
        assert torch.equal(got[k].detach(), v), k
