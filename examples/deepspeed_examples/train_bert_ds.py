# DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py, shrunk to run in seconds on a CPU,
# and ported to tiered by its imports: `import deepspeed` became `import tiered.deepspeed as
# deepspeed`, and `get_accelerator` is imported from tiered.deepspeed.accelerator
# (docs/deepspeed.md lists the lines). The shrink, the same in the original: synthetic token
# sequences instead of WikiText and the roberta-base tokenizer, a tiny RoBERTa, fp32 unless
# --dtype fp16 (the original enables fp16), argparse instead of `fire` (not installed here), no
# git/tensorboard bookkeeping, and `--losses-out` (what tests/test_deepspeed_examples.py compares).
"""Pre-train a small RoBERTa on masked-language modelling with DeepSpeed."""

import argparse
import json
import pathlib

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from transformers.models.roberta.modeling_roberta import (
    RobertaConfig,
    RobertaLMHead,
    RobertaModel,
    RobertaPreTrainedModel,
)

import tiered.deepspeed as deepspeed
from tiered.deepspeed.accelerator import get_accelerator

PAD, MASK, VOCAB = 1, 4, 128


def is_rank_0():
    return torch.distributed.get_rank() == 0


def log_dist(message, ranks=(0,)):
    if torch.distributed.get_rank() in ranks:
        print(f"[Rank {torch.distributed.get_rank()}] {message}", flush=True)


######################################################################
####################### Dataset Related Functions ####################
######################################################################


class SyntheticMLMDataset(Dataset):
    """Token sequences of varied length standing in for WikiText lines, each masked BERT's way:
    a fraction `mask_prob` of the tokens is predicted; of those, most become <mask>, some a
    random token, some stay. The masking is drawn per example from a seed, so every run and
    every order sees the same examples."""

    def __init__(self, n, max_seq_length, mask_prob, random_replace_prob, unmask_replace_prob, seed=0):
        self.n, self.max_len, self.seed = n, max_seq_length, seed
        self.mask_prob, self.random_prob, self.unmask_prob = (
            mask_prob,
            random_replace_prob,
            unmask_replace_prob,
        )

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(self.seed * 100003 + i)
        length = int(torch.randint(self.max_len // 2, self.max_len + 1, (1,), generator=gen))
        tokens = torch.randint(5, VOCAB, (length,), generator=gen)
        chosen = torch.rand(length, generator=gen) < self.mask_prob
        chosen[int(torch.randint(0, length, (1,), generator=gen))] = True  # at least one target
        src, tgt = tokens.clone(), torch.full_like(tokens, PAD)
        tgt[chosen] = tokens[chosen]
        how = torch.rand(length, generator=gen)
        src[chosen & (how >= self.random_prob + self.unmask_prob)] = MASK
        swap = chosen & (how < self.random_prob)
        src[swap] = torch.randint(5, VOCAB, (int(swap.sum()),), generator=gen)
        return src, tgt


def collate_function(batch, pad_token_id):
    """Pad to the longest sequence of the batch; the attention mask marks the real tokens."""
    longest = max(len(src) for src, _ in batch)
    src = torch.full((len(batch), longest), pad_token_id)
    tgt = torch.full((len(batch), longest), pad_token_id)
    for row, (s, t) in enumerate(batch):
        src[row, : len(s)], tgt[row, : len(t)] = s, t
    return {"src_tokens": src, "tgt_tokens": tgt, "attention_mask": (src != pad_token_id).long()}


class InfiniteIterator:
    """Restarts the loader whenever a pass ends, so training runs by iteration count."""

    def __init__(self, iterable):
        self._iterable, self._iterator = iterable, iter(iterable)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


def create_data_iterator(mask_prob, random_replace_prob, unmask_replace_prob, batch_size, max_seq_length=32):
    dataset = SyntheticMLMDataset(256, max_seq_length, mask_prob, random_replace_prob, unmask_replace_prob)
    dataloader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, collate_fn=lambda b: collate_function(b, PAD)
    )
    return InfiniteIterator(dataloader)


######################################################################
############### Model Creation Related Functions #####################
######################################################################


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    """The LM head run on the masked positions only (the original's memory saving)."""

    def __init__(self, config, embedding_weight=None):
        super().__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features, masked_token_indices=None, **kwargs):
        if masked_token_indices is not None:
            features = torch.index_select(features.view(-1, features.shape[-1]), 0, masked_token_indices)
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config, encoder):
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(config, self.encoder.embeddings.word_embeddings.weight)
        self.lm_head.apply(self._init_weights)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        """The MLM loss over the positions whose target is not padding."""
        sequence_output, *_ = self.encoder(
            input_ids=src_tokens, attention_mask=attention_mask, return_dict=False
        )
        masked_token_indexes = torch.nonzero((tgt_tokens != self.config.pad_token_id).view(-1)).view(-1)
        prediction_scores = self.lm_head(sequence_output, masked_token_indexes)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked_token_indexes)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
        return loss_fct(prediction_scores.view(-1, self.config.vocab_size), target)


def create_model(num_layers, num_heads, ff_dim, h_dim, dropout):
    roberta_config = RobertaConfig.from_dict(
        {
            "attention_probs_dropout_prob": dropout,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "hidden_act": "gelu",
            "hidden_dropout_prob": dropout,
            "hidden_size": h_dim,
            "initializer_range": 0.02,
            "intermediate_size": ff_dim,
            "layer_norm_eps": 1e-05,
            "max_position_embeddings": 66,
            "model_type": "roberta",
            "num_attention_heads": num_heads,
            "num_hidden_layers": num_layers,
            "pad_token_id": PAD,
            "type_vocab_size": 1,
            "vocab_size": VOCAB,
        }
    )
    return RobertaMLMModel(roberta_config, RobertaModel(roberta_config))


######################################################################
######################## Driver Functions ############################
######################################################################


def train(
    checkpoint_dir=None,
    mask_prob=0.15,
    random_replace_prob=0.1,
    unmask_replace_prob=0.1,
    max_seq_length=32,
    num_layers=2,
    num_heads=2,
    ff_dim=64,
    h_dim=32,
    dropout=0.1,
    batch_size=8,
    num_iterations=12,
    checkpoint_every=10,
    log_every=2,
    local_rank=-1,
    dtype="fp32",
    seed=0,
    losses_out=None,
):
    """Train a BERT-style encoder on the MLM task; returns the experiment directory."""
    device = (
        torch.device(get_accelerator().device_name(), local_rank)
        if (local_rank > -1) and get_accelerator().is_available()
        else torch.device("cpu")
    )
    torch.manual_seed(seed)
    exp_dir = pathlib.Path(checkpoint_dir) / "bert_pretrain"
    exp_dir.mkdir(parents=True, exist_ok=True)
    data_iterator = create_data_iterator(
        mask_prob=mask_prob,
        random_replace_prob=random_replace_prob,
        unmask_replace_prob=unmask_replace_prob,
        max_seq_length=max_seq_length,
        batch_size=batch_size,
    )
    model = create_model(
        num_layers=num_layers, num_heads=num_heads, ff_dim=ff_dim, h_dim=h_dim, dropout=dropout
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "fp16": {"enabled": dtype == "fp16"},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    log_dist("DeepSpeed engine created")

    losses = []
    for step, batch in enumerate(data_iterator, start=1):
        if step > num_iterations:
            break
        model.train()
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % log_every == 0:
            log_dist(f"Loss: {sum(losses[-log_every:]) / log_every:.4f}")
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
            log_dist(f"Saved model to {exp_dir}")
    if losses_out:
        with open(losses_out, "w") as fh:
            json.dump(losses, fh)
    return exp_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint_dir", default="./bert_experiments")
    parser.add_argument("--num_iterations", type=int, default=12)
    parser.add_argument("--checkpoint_every", type=int, default=10)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--dtype", default="fp32", choices=["fp16", "fp32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--losses-out", dest="losses_out", default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    train(
        checkpoint_dir=args.checkpoint_dir,
        num_iterations=args.num_iterations,
        checkpoint_every=args.checkpoint_every,
        dropout=args.dropout,
        local_rank=args.local_rank,
        dtype=args.dtype,
        seed=args.seed,
        losses_out=args.losses_out,
    )
