"""A data-dependent branch: correct either way, prefetch re-synchronises instead of stopping."""

from __future__ import annotations

import copy

import torch
from torch import nn
from zero_support import build_zp, make_tm, zcfg, zero_grads_by_name


class Branchy(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.a = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.b = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        branch = self.a if h.mean() > 0 else self.b  # data-dependent control flow
        for layer in branch:
            h = torch.tanh(layer(h))
        return self.out(h)


def test_data_dependent_branch(tmp_path):
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    xs = []
    while len(xs) < 6:  # alternate the branch taken: a, a, b, b, a, b
        want_a = len(xs) in (0, 1, 4)
        x = torch.randn(4, 32)
        if (torch.tanh(ref.inp(x)).mean() > 0) == want_a:
            xs.append(x)
    with make_tm(tmp_path) as tm:
        zp = build_zp(model, tm, zcfg(prefetch_bucket_size_numel=2 * 33 * 32), param_tier="nvme")
        hits = []
        for x in xs:
            before = zp.stats()["prefetch_hits"]
            out = model(x)
            assert torch.equal(out, ref(x))
            out.sum().backward()
            zp.finish_backward()
            ref(x).sum().backward()
            hits.append(zp.stats()["prefetch_hits"] - before)
        got = zero_grads_by_name(zp)
        for n, p in ref.named_parameters():
            assert torch.equal(got[n], p.grad), n
        st = zp.stats()
        assert st["divergences"] > 0 and st["trace_invalidations"] >= 2
        # prefetch never switched off: the step after a divergence (same branch again) hits
        # prefetch never switched off: after the trace was replaced (step 2 diverged) step 3 hits,
        # and steps 4 and 5, which diverge again, still prefetch the shared layers
        # (step 1 found step 0's copies still cached: cache hits, no prefetch needed)
        assert hits[3] > 0 and hits[4] > 0 and hits[5] > 0, hits
