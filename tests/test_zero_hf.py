"""Hugging Face models through ZeroParameters: Llama, GPT-2 with tied embeddings, bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from zero_support import build_zp, make_tm, tiny_gpt2, tiny_llama, zcfg, zero_grads_by_name


def _ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 16), generator=g)


@pytest.mark.parametrize("builder", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_hf_grads_equal_plain_torch_with_eviction(tmp_path, builder):
    model = builder()
    ref = copy.deepcopy(model)
    with make_tm(tmp_path, gpu_budget=64 * 1024) as tm:
        zp = build_zp(
            model,
            tm,
            zcfg(param_persistence_threshold_numel=64, max_live_parameters_numel=6000),
            param_tier="nvme",
            grad_tier="cpu",
        )
        for step in range(3):
            ids = _ids(step)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            zp.finish_backward()
            r = ref(input_ids=ids, labels=ids)
            r.loss.backward()
            assert torch.equal(out.loss, r.loss)
            assert torch.equal(out.logits, r.logits)
        got = zero_grads_by_name(zp)
        for n, p in ref.named_parameters():  # named_parameters dedups the tied lm_head
            assert torch.equal(got[n], p.grad), n  # bitwise: see [Note: hooks that only dispatch]
        st = zp.stats()
        assert st["live_numel_peak"] <= 6000
        assert tm.peak_bytes("gpu") <= 64 * 1024
        assert st["prefetch_hits"] > 0 and st["divergences"] == 0


def test_gpt2_tied_embedding_is_one_parameter(tmp_path):
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    with make_tm(tmp_path) as tm:
        zp = build_zp(model, tm)
        names = [e.name for g in zp.groups for e in g.entries]
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names
        sd = zp.gather_full_state_dict()
        assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied


def test_llama_bf16_grads_close_to_fp32(tmp_path):
    model = tiny_llama()
    ref = copy.deepcopy(model)
    with make_tm(tmp_path) as tm:
        zp = build_zp(model, tm, dtype=torch.bfloat16, param_tier="cpu")
        ids = _ids(0)
        out = model(input_ids=ids, labels=ids)
        assert out.logits.dtype == torch.bfloat16
        out.loss.backward()
        s = zp.finish_backward()
        ref(input_ids=ids, labels=ids).loss.backward()
        got = zero_grads_by_name(zp)
        num = sum(float((got[n] - p.grad).pow(2).sum()) for n, p in ref.named_parameters())
        den = sum(float(p.grad.pow(2).sum()) for _, p in ref.named_parameters())
        assert (num / den) ** 0.5 < 0.05  # bf16 compute: a few percent relative error in total
        assert not s.found_inf and abs(s.sq_norm_local - den) / den < 0.1


def test_found_inf_on_overflow(tmp_path):
    model = torch.nn.Linear(4, 1)
    with make_tm(tmp_path) as tm:
        zp = build_zp(model, tm, dtype=torch.float16)
        x = torch.full((2, 4), 60000.0, dtype=torch.float16)
        (model(x).float() * 1e30).sum().backward()
        s = zp.finish_backward()
        assert s.found_inf
        zp.zero_grads()
        model(torch.ones(2, 4, dtype=torch.float16)).float().sum().backward()
        s = zp.finish_backward()
        assert not s.found_inf and s.sq_norm_local > 0
