"""Packing tokenized documents into fixed-length rows, the eval split, and the seeded,
resumable batch iterator.

[Note: packing rule]
As Hugging Face's `run_clm` example (`group_texts`) and TRL's wrapped packing do: the
documents, each ending with EOS, are concatenated in their read order into one stream, which is
cut into consecutive rows of exactly `--seq-len` tokens; the last partial row is dropped (its
size is reported). Labels are the input ids, except tokens masked by the chat rule (-100, see
[Note: chat masking]); nothing is masked at document boundaries and attention runs across them,
as in `run_clm`: the EOS tells the model a document ended. (The model shifts labels by one
itself.)

[Note: batch order and its state]
`--eval-fraction F` holds out round(F x rows) rows (at least 1) chosen by a permutation seeded
with the seed; `--eval-data` packs another source instead. The training rows are visited in
epochs: epoch e is the permutation of the rows drawn from `torch.Generator().manual_seed(seed +
e)`, read `batch_size` rows at a time; a batch may span two epochs. The position is `{"epoch",
"offset", "seed", "rows"}`: `state_dict()` returns it as plain JSON and `load_state_dict()`
restores it (a checkpoint carries it), refusing a state made for another seed or row count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiered.errors import ConfigError
from tiered.finetune.data_sources import IGNORE_INDEX, Document

Batch = dict[str, Any]


@dataclass(frozen=True)
class PackedRows:
    """Rows of `seq_len` tokens: input ids and labels, shape (rows, seq_len)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    documents: int
    tokens: int
    """Tokens of all documents, the dropped tail included."""
    dropped: int
    """Tokens of the last partial row, not trained on."""

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def trained_label_fraction(self) -> float:
        n = self.labels.numel()
        return float((self.labels != IGNORE_INDEX).sum()) / n if n else 0.0

    def take(self, index: torch.Tensor) -> PackedRows:
        return PackedRows(
            self.input_ids[index],
            self.labels[index],
            self.documents,
            int(index.numel()) * int(self.input_ids.shape[1]),
            0,
        )


def pack(docs: Sequence[Document], seq_len: int, source: str) -> PackedRows:
    """Concatenate, then split into rows ([Note: packing rule])."""
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be >= 2 (one token predicts the next), got {seq_len}")
    ids = torch.tensor([t for d in docs for t in d.ids], dtype=torch.long)
    labels = torch.tensor([t for d in docs for t in d.labels], dtype=torch.long)
    n = int(ids.numel())
    rows = n // seq_len
    if rows == 0:
        raise ConfigError(
            f"--data {source}: {n} tokens in {len(docs)} documents, fewer than --seq-len {seq_len}; "
            "use more data or a smaller --seq-len"
        )
    keep = rows * seq_len
    return PackedRows(
        ids[:keep].view(rows, seq_len), labels[:keep].view(rows, seq_len), len(docs), n, n - keep
    )


def split_eval(rows: PackedRows, fraction: float, seed: int) -> tuple[PackedRows, PackedRows]:
    """(train, eval) rows: a seeded random `fraction` of the rows is held out ([Note: batch order
    and its state])."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"--eval-fraction must be between 0 and 1 (exclusive), got {fraction}")
    n_eval = max(1, round(fraction * rows.rows))
    if n_eval >= rows.rows:
        raise ConfigError(
            f"--eval-fraction {fraction}: the data packs into {rows.rows} rows, too few to hold out {n_eval} "
            "and still train; use more data, a smaller --seq-len or --eval-data"
        )
    perm = torch.randperm(rows.rows, generator=torch.Generator().manual_seed(seed))
    held = perm[:n_eval].sort().values
    kept = perm[n_eval:].sort().values
    return rows.take(kept), rows.take(held)


class PackedBatches:
    """The endless, seeded, resumable stream of training batches ([Note: batch order and its
    state]): `next()` gives {"input_ids", "labels"} of shape (batch_size, seq_len)."""

    def __init__(self, rows: PackedRows, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.rows.rows, generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        picked: list[torch.Tensor] = []
        need = self.batch_size
        while need:
            take = self._perm[self.offset : self.offset + need]
            picked.append(take)
            need -= int(take.numel())
            self.offset += int(take.numel())
            if self.offset == self.rows.rows:
                self.epoch += 1
                self.offset = 0
                self._perm = self._permutation(self.epoch)
        index = torch.cat(picked)
        return {"input_ids": self.rows.input_ids[index], "labels": self.rows.labels[index]}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "rows": self.rows.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("epoch", "offset", "seed", "rows") if k not in state]
        if missing:
            raise ConfigError(
                f"data state: missing keys {missing}; was it written by tiered's data iterator?"
            )
        if int(state["seed"]) != self.seed or int(state["rows"]) != self.rows.rows:
            raise ConfigError(
                f"data state: made for seed {state['seed']} and {state['rows']} rows, but this run has seed "
                f"{self.seed} and {self.rows.rows} rows; resume with the same --data, --seq-len and --seed"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < self.rows.rows:
            raise ConfigError(
                f"data state: epoch {epoch} / offset {offset} out of range for {self.rows.rows} rows"
            )
        self.epoch, self.offset = epoch, offset
        self._perm = self._permutation(epoch)


def eval_batches(rows: PackedRows, batch_size: int) -> Iterator[Batch]:
    """Every eval row once, in order, `batch_size` at a time (the last batch may be smaller)."""
    for start in range(0, rows.rows, batch_size):
        yield {
            "input_ids": rows.input_ids[start : start + batch_size],
            "labels": rows.labels[start : start + batch_size],
        }
