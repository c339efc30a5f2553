"""benchmarks/state_format.py --pretrain-steps: the compared formats fine-tune the pre-trained
weights (not _model()'s initialisation) on the fine-tuning third of the text. Not timed."""

from __future__ import annotations

import pytest
import torch
from engine_support import load_benchmark

pytest.importorskip("transformers")


def _bench():
    return load_benchmark("state_format.py", "state_format_bench")


def test_the_fine_tune_starts_from_the_pretrained_weights_on_the_last_third() -> None:
    bench = _bench()
    state = bench.pretrained_state(2)
    fresh = bench._model().state_dict()
    assert any(not torch.equal(state[k], fresh[k]) for k in state)  # it did train
    train, _ = bench._data()
    pre, fine = bench._split(train, True)
    assert pre.numel() + fine.numel() == train.numel() and torch.equal(fine, train[pre.numel() :])
    # the first step's loss is the pre-trained model's on the fine-tuning text's first batch
    model = bench._model()
    model.load_state_dict(state)
    b = bench._batch(fine, torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = float(model(input_ids=b[:, :-1], labels=b[:, 1:].contiguous()).loss)
    result = bench.run("fp32", 1, 1, state, lr=1e-4)
    assert result["curve"][0] == (1, pytest.approx(expected, abs=1e-5))


def test_the_pydoc_corpus_is_real_text_of_bytes() -> None:
    train, held = _bench()._data("pydoc")
    assert train.numel() > 300_000 and held.numel() > 30_000  # ~466 KB of CPython's reference docs
    assert int(train.max()) < 256 and bytes(train[:200].tolist()).isascii()
