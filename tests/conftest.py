"""Suite-wide hygiene: a one-process group that a test leaves behind (tiered.deepspeed.initialize
does, as DeepSpeed does: [Note: one process without a launcher]) is destroyed after it, and the
launcher variables it wrote into the environment are taken back, so the next test does not run as
if launched by torchrun."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_process_group_leaks_into_the_next_test() -> Iterator[None]:
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    env = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    if not had and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch at one intra-op thread for the test: tiny models' threads only contend (2-10x slower
    on a shared 2-core host). Tests of tiny transformers models use it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
