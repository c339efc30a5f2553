"""Suite-wide hygiene: a one-process group that a test leaves behind (tiered.deepspeed.initialize
does, as DeepSpeed does: [Note: one process without a launcher]) is destroyed after it, so the next
test does not run as if launched by torchrun."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_process_group_leaks_into_the_next_test() -> Iterator[None]:
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    yield
    if not had and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
