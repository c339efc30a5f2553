"""docs/deepspeed.md's route for an ``Accelerator()`` training loop (docs/hf.md points there):
``prepare`` becomes ``deepspeed.initialize`` without ``training_data`` and the script keeps its own
DataLoader, so the batches come in the script's order and the losses equal the accelerate loop's
from step 0. Passing the data set as ``training_data`` instead gives DeepSpeed's loader (a
DistributedSampler, shuffled with seed 0): another order, as under DeepSpeed itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import no_leftover_process_group  # noqa: F401 - the fixture
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tiered.deepspeed as deepspeed

pytestmark = pytest.mark.usefixtures("no_leftover_process_group")

CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 2, generator=g))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def accelerate_loop() -> list[float]:
    """The script as written for accelerate (no DeepSpeed): its own unshuffled loader."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    loader = DataLoader(data(), batch_size=4, shuffle=False)
    m, opt, loader = acc.prepare(m, opt, loader)
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(m(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def tiered_loop(pass_training_data: bool) -> list[float]:
    """The same loop ported as docs/deepspeed.md says (prepare -> initialize, backward/step ->
    the engine's), or with the data set handed to initialize."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    loader: Any = DataLoader(data(), batch_size=4, shuffle=False)
    kw = {"training_data": data()} if pass_training_data else {}
    engine, _, ds_loader, _ = deepspeed.initialize(model=m, optimizer=opt, config=CONFIG, **kw)
    losses = []
    try:
        for x, y in ds_loader if pass_training_data else loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    finally:
        engine.close()
    return losses


def test_the_documented_route_keeps_the_scripts_order_and_losses() -> None:
    want = accelerate_loop()
    got = tiered_loop(pass_training_data=False)
    assert len(got) == len(want) == 8
    assert got == pytest.approx(want, abs=1e-5)


def test_training_data_gives_deepspeeds_shuffled_order_instead() -> None:
    """What docs/deepspeed.md says changes the order: the first loss is already another batch's."""
    want = accelerate_loop()
    shuffled = tiered_loop(pass_training_data=True)
    assert len(shuffled) == len(want)
    assert shuffled[0] != pytest.approx(want[0], abs=1e-5)
