"""TieredTrainer: transformers' Trainer (and TRL's SFTTrainer) on tiered's engine. Tiny local
models, nothing downloaded."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import no_leftover_process_group, tiny_llama  # noqa: F401 - the fixture
from torch.utils.data import Dataset, SequentialSampler

transformers = pytest.importorskip("transformers")  # the hf extra

import tiered.deepspeed as deepspeed  # noqa: E402
from tiered.errors import ConfigError  # noqa: E402
from tiered.integrations.hf import TieredTrainer, tiered_trainer  # noqa: E402


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 16, length: int = 12) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class InOrder(TieredTrainer):  # type: ignore[misc, valid-type]
    """Sequential batches, and each micro-batch's loss recorded (what the Trainer computed)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.model_accepts_loss_kwargs = False  # mean loss per micro-batch, as tiered's own loop
        self.seen: list[float] = []

    def _get_train_sampler(self, *a: Any, **kw: Any) -> Any:
        return SequentialSampler(self.train_dataset)

    def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        loss = super().compute_loss(model, inputs, *a, **kw)
        self.seen.append(float(loss.detach()))
        return loss


CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "sub_group_size": 4000,
        "stage3_param_persistence_threshold": 0,
    },
}

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")


def args(tmp: Path, **kw: Any) -> Any:
    base = dict(
        output_dir=str(tmp),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=0.5,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def model_at(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_llama()


def test_trainer_equals_tiereds_own_loop_and_save_model_loads(tmp_path: Path) -> None:
    data = Tokens()
    trainer = InOrder(model=model_at(), args=args(tmp_path), train_dataset=data, tiered_config=CONFIG)
    trainer.train()
    engine = trainer.engine
    assert engine is not None and engine.global_steps == 2
    assert engine.config.gradient_clipping == 0.5 and engine.gas == 2
    trained = {k: v.clone() for k, v in engine.zero.gather_full_state_dict().items()}
    trainer.save_model(str(tmp_path / "final"))
    engine.close()

    # tiered's own loop: the same config, keywords and HF's scheduler on the returned optimizer
    eng, opt, _, _ = deepspeed.initialize(
        model=model_at(),
        config=copy.deepcopy(CONFIG),
        lr=1e-2,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        weight_decay=0.0,
    )
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, 2)
    own = []
    with eng:
        for i in range(4):
            b = {
                k: torch.stack([data[j][k] for j in range(4 * i, 4 * i + 4)]) for k in ("input_ids", "labels")
            }
            loss = eng(**b).loss
            own.append(float(loss.detach()))
            eng.backward(loss)
            eng.step()
            if eng.was_step_applied():
                sched.step()
        mine = eng.zero.gather_full_state_dict()
    assert trainer.seen == pytest.approx(own, abs=1e-5)
    for k, v in mine.items():
        torch.testing.assert_close(trained[k], v, atol=1e-5, rtol=0)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_resume_from_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    data = Tokens()
    run = dict(max_steps=4, save_strategy="steps", save_steps=2)
    a = InOrder(model=model_at(), args=args(tmp_path / "a", **run), train_dataset=data, tiered_config=CONFIG)
    a.train()
    assert a.engine is not None
    full = a.engine.zero.gather_full_state_dict()
    a.engine.close()
    assert (tmp_path / "a" / "checkpoint-2" / "tiered").is_dir()

    b = InOrder(model=model_at(1), args=args(tmp_path / "b", **run), train_dataset=data, tiered_config=CONFIG)
    b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert b.engine is not None
    resumed = b.engine.zero.gather_full_state_dict()
    b.engine.close()
    assert b.seen == a.seen[4:]
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_a_trainer_lr_that_contradicts_the_config(tmp_path: Path) -> None:
    cfg = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}
    trainer = TieredTrainer(model=model_at(), args=args(tmp_path), train_dataset=Tokens(), tiered_config=cfg)
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr = 0\.003 in the config but lr=0\.01"):
        trainer.train()


def test_an_optimizer_tiered_cannot_offload(tmp_path: Path) -> None:
    trainer = TieredTrainer(
        model=model_at(), args=args(tmp_path, optim="sgd"), train_dataset=Tokens(), tiered_config=CONFIG
    )
    with pytest.raises(ConfigError, match="optim='sgd'.*adamw_torch"):
        trainer.train()


def _chat_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "<pad> <unk> <eos> <|user|> <|assistant|> hi hello how are you fine thanks what is two plus four six".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return fast


def test_trl_sft_trainer_on_a_tiny_chat_dataset(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    from datasets import Dataset as HFDataset

    chats = [
        [{"role": "user", "content": "hi how are you"}, {"role": "assistant", "content": "fine thanks"}],
        [{"role": "user", "content": "what is two plus four"}, {"role": "assistant", "content": "six"}],
    ] * 4
    ds = HFDataset.from_dict({"messages": chats})
    sft_args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        max_length=32,
        disable_tqdm=True,
    )
    TieredSFT = tiered_trainer(trl.SFTTrainer)
    trainer = TieredSFT(
        model=model_at(),
        args=sft_args,
        train_dataset=ds,
        processing_class=_chat_tokenizer(),
        tiered_config=CONFIG,
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.engine is not None and trainer.engine.global_steps == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(x == x and x > 0 for x in losses)
    after = trainer.engine.zero.gather_full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after)
    trainer.save_model(str(tmp_path / "out"))
    trainer.engine.close()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, after[k]), k


def test_an_epoch_that_ends_inside_an_accumulation_window(tmp_path: Path) -> None:
    trainer = TieredTrainer(
        model=model_at(), args=args(tmp_path), train_dataset=Tokens(n=12), tiered_config=CONFIG
    )
    with pytest.raises(ConfigError, match=r"3 batches, not a multiple of gradient_accumulation_steps \(2\)"):
        trainer.train()


def _logged_lrs(trainer: Any) -> list[float]:
    return [float(e["learning_rate"]) for e in trainer.state.log_history if "learning_rate" in e]


def test_the_logged_learning_rate_is_the_one_hf_logs(tmp_path: Path) -> None:
    # the Trainer's own scheduler: HF logs the lr each step used (read before it steps the
    # scheduler), with DeepSpeed too ([0, .005, .01, .005] here on DeepSpeed 0.19.8).
    # Warmup over 2 of 4 steps makes the values differ.
    run = dict(max_steps=4, warmup_steps=2)
    plain = transformers.Trainer(
        model=model_at(), args=args(tmp_path / "plain", **run), train_dataset=Tokens(n=32)
    )
    plain.train()
    tiered = TieredTrainer(
        model=model_at(),
        args=args(tmp_path / "tiered", **run),
        train_dataset=Tokens(n=32),
        tiered_config=CONFIG,
    )
    tiered.train()
    assert tiered.engine is not None
    tiered.engine.close()
    expected = _logged_lrs(plain)
    assert len(expected) == 4 and len(set(expected)) > 2
    assert _logged_lrs(tiered) == pytest.approx(expected, rel=1e-9)


def test_the_logged_learning_rate_with_a_config_scheduler(tmp_path: Path) -> None:
    # the config's WarmupLR drives the lr: HF on DeepSpeed reads it after the engine's step stepped
    # it, so at step k the log shows the scheduler's lr after step k. HF's Trainer with
    # deepspeed=this config on DeepSpeed 0.19.8's CPU engine logged [0, 1/3, 2/3, 1] * 1e-2.
    cfg = {
        **CONFIG,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
    }

    class AfterEachStep(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.lrs: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.lrs.append(float(kw["optimizer"].param_groups[0]["lr"]))

    seen = AfterEachStep()
    trainer = TieredTrainer(
        model=model_at(),
        args=args(tmp_path, max_steps=4, warmup_steps=3),
        train_dataset=Tokens(n=32),
        tiered_config=cfg,
        callbacks=[seen],
    )
    trainer.train()
    assert trainer.engine is not None
    after = [float(x) for x in trainer.engine.lr_scheduler.get_last_lr()]
    trainer.engine.close()
    assert len(seen.lrs) == 4 and len(set(seen.lrs)) > 2
    assert _logged_lrs(trainer) == pytest.approx(seen.lrs, rel=1e-9)
    assert seen.lrs[-1] == pytest.approx(after[0], rel=1e-9)
    assert _logged_lrs(trainer) == pytest.approx([0.0, 1e-2 / 3, 2e-2 / 3, 1e-2], rel=1e-9)
