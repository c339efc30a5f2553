"""Data-parallel fine-tuning under torchrun: each rank's slice of the global batch.

[Note: ranks in finetune]
Under torchrun (WORLD_SIZE = N > 1; the process group is set up as in [Note: process group from
torchrun]) every rank reads the same seeded stream of global micro-batches of N x --batch-size
rows ([Note: batch order and its state]) and keeps rows [r x B, (r + 1) x B) of each: the ranks
see disjoint slices, the union is exactly what one process would see with --batch-size N x B,
and the order depends on the seed only. --batch-size stays per rank, as DeepSpeed's
train_micro_batch_size_per_gpu. The engine averages gradients over ranks, so with rows of equal
trained-token counts (packed text) N ranks step exactly as one rank on the global batch. The
logged loss is the mean of the ranks' losses and tokens count the global batch. Only rank 0
prints, writes --stats-json, the trace and the plot; the data position (`state_dict`) is the
global stream's, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tiered.errors import ConfigError

Batch = dict[str, Any]


class RankSlice:
    """Rank `rank`'s rows of each batch of `stream` (split into `world` equal parts along dim 0)."""

    def __init__(self, stream: Iterator[Batch], rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} is outside the world of {world} ranks")
        self.stream, self.rank, self.world = stream, rank, world

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = next(self.stream)
        rows = int(batch["input_ids"].shape[0])
        if rows % self.world:
            raise ConfigError(
                f"a global batch of {rows} rows does not split into {self.world} equal rank slices"
            )
        per = rows // self.world
        return {k: v[self.rank * per : (self.rank + 1) * per] for k, v in batch.items()}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.stream.state_dict()  # type: ignore[attr-defined]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)  # type: ignore[attr-defined]
