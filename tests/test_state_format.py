"""[Note: compressed optimizer state]: the codecs' round-trip error within their stated bounds,
unbiased rounding, Adam with compressed moments against exact Adam, the format key and the
checkpoint rule."""

from __future__ import annotations

import math

import pytest
import torch

from tiered.config import dump_config, load_config
from tiered.config.schema import OPTIMIZER_STATE_FORMATS
from tiered.errors import CheckpointMismatchError, ConfigError, UnsupportedConfigError
from tiered.optim.rounding_noise import RoundingNoise, noise_key
from tiered.optim.state_codecs import BLOCK, MomentCodec
from tiered.optim.state_format import (
    FORMATS,
    adam_step_compressed,
    check_checkpoint_format,
    state_format,
)

LOSSY = ("bf16", "int8")


def _roundtrip(codec: MomentCodec, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    buf = torch.empty(codec.encoded_bytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, buf, RoundingNoise(noise_key(seed)))
    out = torch.empty_like(x)
    codec.decode(buf, out)
    return out


def _wide(n: int, seed: int, signed: bool) -> torch.Tensor:
    """Values over 12 decades, in blocks whose maxima differ, with exact zeros and ragged sizes."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(n).uniform_(math.log(1e-12), 0.0, generator=g))
    x = mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) if signed else mag
    x[::17] = 0.0
    return x


def _moments(fmt_name: str):
    f = FORMATS[fmt_name]
    return ((f.exp_avg, True), (f.exp_avg_sq, False))


# ---- the formats ------------------------------------------------------------------------------
def test_the_config_names_the_formats_the_codecs_implement() -> None:
    assert tuple(FORMATS) == OPTIMIZER_STATE_FORMATS == ("fp32", "bf16", "int8")
    n = 1 << 20
    assert FORMATS["fp32"].state_bytes(n) == 12 * n
    assert FORMATS["bf16"].state_bytes(n) == 8 * n
    assert FORMATS["int8"].state_bytes(n) == 4 * n + 2 * (n + 4 * n // BLOCK)  # 6.03 B / param
    assert FORMATS["fp32"].lossless and not FORMATS["bf16"].lossless and not FORMATS["int8"].lossless


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", OPTIMIZER_STATE_FORMATS)
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 5000])
def test_round_trip_error_is_within_the_stated_bound(fmt: str, n: int) -> None:
    for codec, signed in _moments(fmt):
        for seed in range(3):
            x = _wide(n, seed, signed)
            out = _roundtrip(codec, x, seed)
            err = (out - x).abs()
            bound = codec.error_bound(x)
            assert bool((err <= bound).all()), f"{codec.name}: max excess {float((err - bound).max())}"
            assert bool((out[x == 0] == 0).all()), f"{codec.name}: zero not exact"
            if not signed:
                assert bool((out >= 0).all()), f"{codec.name}: exp_avg_sq decoded negative"


def test_the_bounds_are_the_documented_ones() -> None:
    """The table of the Note, checked on the codes themselves (not through error_bound)."""
    x = _wide(64 * BLOCK, 5, signed=True)
    v = x * x
    for seed in range(4):
        bf = _roundtrip(FORMATS["bf16"].exp_avg, x, seed)
        nz = x != 0
        assert bool(((bf - x).abs()[nz] < 2.0**-7 * x.abs()[nz]).all())
        m8 = _roundtrip(FORMATS["int8"].exp_avg, x, seed)
        top = x.abs().view(-1, BLOCK).amax(1, keepdim=True).expand(-1, BLOCK).reshape(-1)
        above = x.abs() >= 1.815e-5 * top  # 2^-15.75: the smallest level
        assert bool(((m8 - x).abs()[above] <= 0.0906 * x.abs()[above]).all())  # 2^(1/8) - 1
        assert bool(((m8 - x).abs()[~above] <= 1.815e-5 * top[~above]).all())
        s8 = _roundtrip(FORMATS["int8"].exp_avg_sq, v, seed).sqrt()
        s, stop = v.sqrt(), v.sqrt().view(-1, BLOCK).amax(1, keepdim=True).expand(-1, BLOCK).reshape(-1)
        above = s >= 1.665e-5 * stop  # 2^-15.875
        assert bool(((s8 - s).abs()[above] <= 0.0443 * s[above]).all())  # 2^(1/16) - 1
        assert bool(((s8 - s).abs()[~above] <= 1.665e-5 * stop[~above]).all())


@pytest.mark.parametrize("fmt", LOSSY)
def test_rounding_is_unbiased(fmt: str) -> None:
    """The mean of many encodings is the value (round-to-nearest is off by up to half a step)."""
    for codec, signed in _moments(fmt):
        x = _wide(2 * BLOCK, 9, signed)
        x[: BLOCK // 2] = x[: BLOCK // 2].sign() * 0.37  # well above each block's smallest level
        draws = 600
        mean = torch.stack([_roundtrip(codec, x, seed) for seed in range(draws)]).mean(0)
        if not signed:  # v is unbiased in sqrt(v): compare there
            mean = torch.stack([_roundtrip(codec, x, seed).sqrt() for seed in range(draws)]).mean(0)
            x = x.sqrt()
            bound = _bound_on_stored(codec, x)
        else:
            bound = codec.error_bound(x)
        # each draw is within `bound` of x: the mean of `draws` is within 5 sigma <= 5 bound / sqrt(draws)
        assert bool(((mean - x).abs() <= 5 * bound / math.sqrt(draws) + 1e-30).all()), codec.name


def _bound_on_stored(codec: MomentCodec, s: torch.Tensor) -> torch.Tensor:
    """The bound on the stored sqrt(v) itself, from the v bound d(2s + d) solved for d."""
    dv = codec.error_bound(s * s)
    return torch.sqrt(s * s + dv) - s


@pytest.mark.parametrize("fmt", LOSSY)
def test_a_decaying_moment_decays(fmt: str) -> None:
    """exp_avg_sq under zero gradients must shrink by beta2 per step: 0.1% a step, far below half
    a step of bf16 or the 8-bit code, so nearest rounding would hold it where it is. The first
    element of each block keeps getting gradients of 1 (so it stays at 1, and the block's scale
    with it: the others must move on their own codes)."""
    codec = FORMATS[fmt].exp_avg_sq
    v = torch.full((4 * BLOCK,), 0.5)
    v[::2] = 0.125
    held = torch.zeros_like(v, dtype=torch.bool)
    held[::BLOCK] = True
    v[held] = 1.0
    start = v.clone()
    buf = torch.empty(codec.encoded_bytes(v.numel()), dtype=torch.uint8)
    for it in range(1000):
        v.mul_(0.999).add_(held.float(), alpha=0.001)
        codec.encode(v, buf, RoundingNoise(noise_key(3, it)))
        codec.decode(buf, v)
    want = start[~held] * 0.999**1000
    assert abs(float(v[~held].mean() / want.mean()) - 1) < 0.05
    assert abs(float(v[held].mean()) - 1) < 0.02


def test_a_non_finite_block_decodes_as_nan_not_as_numbers() -> None:
    codec = FORMATS["int8"].exp_avg
    x = torch.linspace(-1, 1, 3 * BLOCK)
    x[BLOCK + 3] = math.inf
    out = _roundtrip(codec, x)
    assert bool(out[BLOCK : 2 * BLOCK].isnan().all())
    assert bool(torch.isfinite(out[:BLOCK]).all() and torch.isfinite(out[2 * BLOCK :]).all())
    bf = _roundtrip(FORMATS["bf16"].exp_avg, torch.tensor([math.inf, -math.inf, math.nan, 3.0e38]))
    assert bf[0] == math.inf and bf[1] == -math.inf and bf[2].isnan() and math.isfinite(float(bf[3]))


# ---- Adam with compressed moments -------------------------------------------------------------
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _encoded(codec: MomentCodec, x: torch.Tensor, seed: int) -> torch.Tensor:
    buf = torch.empty(codec.encoded_bytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, buf, RoundingNoise(noise_key(seed)))
    return buf


@pytest.mark.parametrize("fmt", LOSSY)
def test_one_adam_step_stays_within_the_bound_from_the_codec_errors(fmt: str) -> None:
    """From the same state, a step with encoded moments moves each parameter within lr x B of the
    exact step, B derived from the codecs' bounds on the stored m and v (see the formula below)."""
    f = FORMATS[fmt]
    n, step = 8 * BLOCK + 5, 50
    g = torch.Generator().manual_seed(1)
    scale = torch.exp(torch.empty(n).uniform_(-9, 0, generator=g))  # per-element gradient scales
    m = torch.zeros(n)
    v = torch.zeros(n)
    p0 = torch.randn(n, generator=g)
    for _ in range(step - 1):  # realistic moments: exact Adam's after 49 noisy gradients
        grad = scale * (0.3 + torch.randn(n, generator=g))
        m.lerp_(grad, 0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
    grad = scale * (0.3 + torch.randn(n, generator=g))
    exact_p, em, ev = p0.clone(), m.clone(), v.clone()
    import tiered_ext

    tiered_ext.adam_step(exact_p, grad, em, ev, step=step, **HYPER)
    comp_p = p0.clone()
    mb, vb = _encoded(f.exp_avg, m, 2), _encoded(f.exp_avg_sq, v, 3)
    adam_step_compressed(comp_p, grad, mb, vb, f, step=step, group=4, **HYPER)

    b1, b2, eps, lr = HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["lr"]
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    dm = b1 * f.exp_avg.error_bound(m)  # |m_t' - m_t|: only the stored part differs
    dv = b2 * f.exp_avg_sq.error_bound(v)
    a = em.abs() / bc1
    den = ev.div(bc2).sqrt() + eps
    dden = (dv / bc2).sqrt()  # |sqrt(x) - sqrt(y)| <= sqrt(|x - y|)
    low = (den - dden).clamp_min(eps)  # the compressed denominator is at least this (and eps)
    bound = lr * ((dm / bc1) / low + a * dden / (low * den)) * (1 + 1e-5) + 1e-7 * lr
    diff = (comp_p - exact_p).abs()
    assert bool((diff <= bound).all()), f"max excess {float((diff - bound).max())} (lr {lr})"
    assert float(diff.max()) > 0, "the compressed step did not differ at all: nothing was compressed"


def _train(fmt: str | None, steps: int = 200) -> list[float]:
    """A small least-squares model, Adam on flat fp32 parameters; `fmt` None: exact fp32 Adam."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    w_true = torch.randn(64, 8, generator=g)
    y = x @ w_true + 0.01 * torch.randn(256, 8, generator=g)
    w = torch.zeros(64 * 8, requires_grad=True)
    m, v = torch.zeros(w.numel()), torch.zeros(w.numel())
    f = FORMATS[fmt] if fmt else None
    mb = _encoded(f.exp_avg, m, 0) if f else None
    vb = _encoded(f.exp_avg_sq, v, 0) if f else None
    losses = []
    hyper = dict(HYPER, lr=0.02, weight_decay=0.0)
    import tiered_ext

    for step in range(1, steps + 1):
        loss = ((x @ w.view(64, 8) - y) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, w)
        losses.append(float(loss.detach()))
        with torch.no_grad():
            if f is None:
                tiered_ext.adam_step(w, grad, m, v, step=step, **hyper)
            else:
                adam_step_compressed(w, grad, mb, vb, f, step=step, group=11, **hyper)
    return losses


@pytest.mark.parametrize("fmt", LOSSY)
def test_training_with_compressed_moments_follows_exact_adam(fmt: str) -> None:
    exact, comp = _train(None), _train(fmt)
    assert exact[-1] < 0.05 * exact[0]  # the problem is learned
    for i in (50, 100, 199):
        assert abs(comp[i] - exact[i]) <= 0.15 * exact[i] + 1e-4, (i, comp[i], exact[i])


# ---- bad input --------------------------------------------------------------------------------
def test_an_unknown_format_is_refused_naming_the_ones_that_exist() -> None:
    with pytest.raises(
        ConfigError, match=r"'fp8' is not an optimizer-state format; use one of 'fp32', 'bf16', 'int8'"
    ):
        state_format("fp8")
    with pytest.raises(
        ConfigError,
        match=r"tiered.optimizer_state_format = 'int4' is not an optimizer-state format; use one of 'fp32', 'bf16', 'int8'",
    ):
        load_config({"tiered": {"optimizer_state_format": "int4"}})


def test_a_compressed_format_with_a_non_adam_optimizer_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"'int8' compresses Adam's .*'Lion'"):
        state_format("int8", optimizer="Lion")
    assert state_format("fp32", optimizer="Lion").name == "fp32"
    with pytest.raises(
        UnsupportedConfigError, match=r"tiered.optimizer_state_format = 'bf16' compresses Adam's .*'Lamb'"
    ):
        load_config({"optimizer": {"type": "Lamb"}, "tiered": {"optimizer_state_format": "bf16"}})


def test_the_key_resolves_and_is_dumped() -> None:
    assert load_config({}).tiered.optimizer_state_format == "fp32"
    cfg = load_config({"optimizer": {"type": "AdamW"}, "tiered": {"optimizer_state_format": "int8"}})
    assert cfg.tiered.optimizer_state_format == "int8"
    assert dump_config(cfg)["tiered"]["optimizer_state_format"] == "int8"  # so checkpoints record it


def test_checkpoint_formats_convert_only_where_exact() -> None:
    for name in OPTIMIZER_STATE_FORMATS:
        assert check_checkpoint_format(name, name, path="ck") == "same"
    assert check_checkpoint_format("bf16", "fp32", path="ck") == "decode"
    assert check_checkpoint_format("int8", "fp32", path="ck") == "decode"
    for saved, running in (("fp32", "bf16"), ("fp32", "int8"), ("bf16", "int8"), ("int8", "bf16")):
        with pytest.raises(
            CheckpointMismatchError,
            match=rf"ck holds the optimizer state in format '{saved}', this run stores it as '{running}'",
        ):
            check_checkpoint_format(saved, running, path="ck")
    with pytest.raises(CheckpointMismatchError, match=r"format 'fp16' is unknown"):
        check_checkpoint_format("fp16", "fp32", path="ck")


def test_codecs_share_the_argument_checks_and_the_layout_of_fixed_width_elements() -> None:
    """encode / decode (checks, the default noise) and the sizes of a fixed-width codec are
    written once, on MomentCodec; each codec writes only its coding (each once repeated them)."""
    from tiered.optim.state_codecs import Bf16StochasticCodec, BlockLogCodec, Fp32Codec

    for cls in (Fp32Codec, Bf16StochasticCodec, BlockLogCodec):
        assert {"encode", "decode", "storage"}.isdisjoint(vars(cls)), cls.__name__
    assert "encoded_bytes" not in vars(Fp32Codec) and "encoded_bytes" not in vars(Bf16StochasticCodec)
    assert Fp32Codec().storage(3) == (3, torch.float32) and Bf16StochasticCodec().encoded_bytes(3) == 6
    with pytest.raises(ValueError, match="bf16 encode"):
        Bf16StochasticCodec().encode(torch.zeros(4), torch.zeros(7, dtype=torch.uint8))
