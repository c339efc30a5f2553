"""Saves checkpoints in a loop until killed (tests/test_checkpoint_format.py's random-kill test).

usage: python checkpoint_kill_worker.py SAVE_DIR FIRST_STEP; prints each step once it is saved."""

from __future__ import annotations

import sys

import torch

from tiered.checkpoint import save_tensors


def tensors_for(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(256 * 1024, generator=g) for i in range(6)}  # 6 MiB per checkpoint


def main() -> None:
    save_dir, step = sys.argv[1], int(sys.argv[2])
    while True:
        save_tensors(
            save_dir,
            f"step{step}",
            tensors_for(step),
            {"counters": {"global_steps": step}},
            chunk_bytes=64 * 1024,
        )
        print(step, flush=True)
        step += 1


if __name__ == "__main__":
    main()
