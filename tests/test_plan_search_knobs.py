"""The search's sized knobs and its time model: [Note: the live budget searched] (what the gpu
tier keeps between forward and backward), ``tiered.overlap_step_with_backward`` where it
applies, and the compute term of [Note: step time model]."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import small_llama_config

import tiered
from tiered.planning.candidate import Base, plan_base
from tiered.planning.search import Memories, Pinned, search, weigh
from tiered.planning.timing import DEFAULT_BANDWIDTH, forward_fraction, seconds_per_step, training_flops

transformers = pytest.importorskip("transformers")

ALL_NVME = {
    "offload_optimizer": "nvme",
    "offload_param": "nvme",
    "grad_tier": "nvme",
    "sub_group_size": 100_000_000,
    "buffer_count": 2,
    "persistence_threshold": 100_000,
}


NO_RESIDENCY = Base.read({"bf16": {"enabled": True}, "tiered": {"residency": "off"}})
"""A plan's base whose cpu tier keeps nothing beyond DeepSpeed's max_in_cpu: the disk path weighed."""


def _meta(**kw: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(small_llama_config(**kw))


def test_search_keeps_parameters_for_the_backward_when_the_gpu_has_room(tmp_path: Path) -> None:
    """A 1.7B model, parameters on NVMe: on an 80 GB GPU the forward's copies are kept for the
    backward (the live budget grows, or the gpu budget's room holds the groups persistent: [Note:
    persistent by room]) and the backward reads nothing again; on a small GPU it re-reads."""
    model = _meta(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )
    params = sum(p.numel() for p in model.parameters())
    # the activations' memory declared (here none): the GPU's room is the parameters' to take
    nv = str(tmp_path)
    roomy = search(
        model, Memories(gpu=80 * 10**9, cpu=64 * 10**9, activations=0), Pinned(ALL_NVME), nvme_path=nv
    ).best
    tight = search(
        model, Memories(gpu=25 * 10**8, cpu=64 * 10**9, activations=0), Pinned(ALL_NVME), nvme_path=nv
    ).best
    # not known: that room may be the activations', the default live budget is kept
    unknown = search(model, Memories(gpu=80 * 10**9, cpu=64 * 10**9), Pinned(ALL_NVME), nvme_path=nv).best
    assert roomy is not None and tight is not None and unknown is not None
    assert unknown.config["zero_optimization"].get("stage3_max_live_parameters") is None
    assert unknown.config["tiered"]["residency"] == "host"  # nor the persistent groups grown
    assert "residency" not in roomy.config["tiered"]

    def persistent(c: Any) -> int:
        return sum(g.full_numel for g in c.prediction.groups if g.persistent)

    zero = roomy.config["zero_optimization"]
    grown = persistent(roomy) > 10 * persistent(unknown)
    assert grown or zero["stage3_max_live_parameters"] > 1_000_000_000  # above DeepSpeed's default
    # read once per step (bf16): the forward's copy kept for the backward (a persistent group's
    # once after each step changed it)
    assert roomy.traffic["host->device"] == pytest.approx(2 * params, rel=0.01)
    assert tight.traffic["host->device"] > 1.2 * roomy.traffic["host->device"]  # what did not fit is re-read
    # the kept bytes are counted on the GPU, within what was given
    assert 2 * params <= roomy.peaks["device"] <= 80 * 10**9
    assert tight.peaks["device"] <= 25 * 10**8


@pytest.mark.parametrize("gpu", [512 * 2**20, 2**30])
def test_the_live_budget_goes_down_where_the_default_does_not_fit_the_gpu(gpu: int, tmp_path: Path) -> None:
    """A 0.55B model on a GPU smaller than its gathered bf16 parameters (the default live budget,
    1e9, keeps them all): a smaller budget fits and re-reads, not "nothing fits"."""
    from tiered.planning.shape_model import shape_model

    model, _ = shape_model(550_000_000)
    result = search(model, Memories(gpu=gpu, cpu=6 * 2**30, nvme=10**11), nvme_path=str(tmp_path))
    best = result.best
    assert best is not None, [c.shortfalls for c in result.weighed[:3]]
    live = best.config["zero_optimization"]["stage3_max_live_parameters"]
    assert live < 550_000_000 and best.peaks["device"] <= gpu
    gathered = sum(g.full_numel for g in best.prediction.groups if not g.persistent)  # type: ignore[union-attr]
    assert best.traffic["host->device"] > 2 * gathered  # what the budget cannot keep is read again


def test_a_pinned_live_budget_is_the_only_one_weighed(tmp_path: Path) -> None:
    model = _meta(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )
    pinned = Pinned({**ALL_NVME, "max_live_parameters": 300_000_000})
    best = search(model, Memories(gpu=80 * 10**9, cpu=64 * 10**9), pinned, nvme_path=str(tmp_path)).best
    assert best is not None
    assert best.config["zero_optimization"]["stage3_max_live_parameters"] == 300_000_000
    assert best.knobs["max_live_parameters"] == 300_000_000


def test_the_engine_preflight_accepts_the_sized_live_budget(tmp_path: Path) -> None:
    """A GPU smaller than the gathered model: the default live budget (1e9) is not counted as
    fitting; the budget written is one the gpu tier holds, and the engine built from the
    recommended config counts what the plan predicted ([Note: one memory model])."""
    model = _meta(num_hidden_layers=4)
    gathered = sum(p.numel() for p in model.parameters()) * 2  # bf16
    gpu = gathered // 2
    pinned = Pinned({**ALL_NVME, "persistence_threshold": 0})  # every group gathered
    result = search(model, Memories(gpu=gpu, cpu=4 * 2**30, activations=0), pinned, nvme_path=str(tmp_path))
    best = result.best
    assert best is not None and best.prediction is not None
    live = best.config["zero_optimization"]["stage3_max_live_parameters"]
    assert live * 2 <= gpu and best.peaks["device"] <= gpu
    assert best.peaks["device"] >= best.prediction.tier_bytes("device") + live * 2 - gathered // 2
    config = copy.deepcopy(best.config)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    real = transformers.AutoModelForCausalLM.from_config(model.config)
    with tiered.initialize(real, config) as engine:
        assert engine.capacity == best.prediction.needs
        ids = torch.randint(0, 512, (1, 16))
        for _ in range(2):  # it trains under that budget (the backward re-reads what was evicted)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        assert torch.isfinite(loss)
        zero = engine.stats()["zero"]
        assert zero["max_live_numel"] == live and 0 < zero["live_numel_peak"] <= live


def test_overlap_step_chosen_only_where_it_applies(tmp_path: Path) -> None:
    model = _meta()
    mem = Memories(gpu=8 * 2**30, cpu=8 * 2**30)

    def one(knobs: dict[str, Any], **kw: Any) -> Any:
        kw.setdefault("base", NO_RESIDENCY)  # the subject is the gradients' disk round trip
        return weigh(model, {**knobs, "max_in_cpu": 0}, mem, nvme_path=str(tmp_path), **kw)

    on = one(ALL_NVME)
    assert on.config["tiered"]["overlap_step_with_backward"] is True
    assert on.knobs["overlap_step"] is True
    off = one({**ALL_NVME, "overlap_step": False})  # the user's explicit false
    assert "overlap_step_with_backward" not in off.config["tiered"]
    # no gradient round trip through NVMe with it: the disk reads drop by the gradients' 4 B
    assert on.traffic["disk->host"] < off.traffic["disk->host"]
    for base in (plan_base(accumulation=2), plan_base("fp16")):
        assert "overlap_step_with_backward" not in one(ALL_NVME, base=base).config["tiered"]
    bf16 = {"bf16": {"enabled": True}}
    clipped = one(ALL_NVME, base=Base.read({**bf16, "gradient_clipping": 1.0}))
    assert "overlap_step_with_backward" not in clipped.config["tiered"]
    # a clipping left to the caller ("auto", Hugging Face's) may be > 0: not chosen either
    later = one(ALL_NVME, base=Base.read({**bf16, "gradient_clipping": "auto"}))
    assert "overlap_step_with_backward" not in later.config["tiered"]
    said = one(ALL_NVME, base=Base.read({**bf16, "tiered": {"overlap_step_with_backward": False}}))
    assert said.config["tiered"]["overlap_step_with_backward"] is False
    cpu_grads = one({**ALL_NVME, "grad_tier": "cpu"})
    assert "overlap_step_with_backward" not in cpu_grads.config["tiered"]


def test_compute_term_scales_with_tokens_and_the_flop_rate() -> None:
    assert training_flops(1000, 10) == 60_000
    assert training_flops(1000, 10, checkpointing=True) == 80_000
    traffic = {"disk->host": 0, "host->disk": 0, "host->device": 0, "device->host": 0}
    bw = {**DEFAULT_BANDWIDTH, "flops": 1e9}
    one = seconds_per_step(traffic, 0, bw, compute_flops=training_flops(10**6, 1000))
    assert one == pytest.approx(6.0)
    assert seconds_per_step(traffic, 0, bw, compute_flops=training_flops(10**6, 2000)) == pytest.approx(12.0)
    faster = {**bw, "flops": 2e9}
    assert seconds_per_step(traffic, 0, faster, compute_flops=training_flops(10**6, 1000)) == pytest.approx(
        3.0
    )
    # without a GPU the CPU Adam shares the cores: it adds to the compute
    adam = int(bw["cpu_adam"])
    assert seconds_per_step(traffic, adam, bw, compute_flops=6e9) == pytest.approx(6.0)
    assert seconds_per_step(traffic, adam, bw, compute_flops=6e9, shared_cores=True) == pytest.approx(7.0)


def test_search_counts_the_compute_when_tokens_are_given(tmp_path: Path) -> None:
    model = _meta()
    params = sum(p.numel() for p in model.parameters())
    bw = {**DEFAULT_BANDWIDTH, "flops": 1e6}  # slow enough that compute bounds every config
    mem = Memories(gpu=8 * 2**30, cpu=8 * 2**30)
    kw = {"bandwidth": bw, "nvme_path": str(tmp_path)}
    without = search(model, mem, Pinned(ALL_NVME), **kw).best
    small = search(model, mem, Pinned(ALL_NVME), tokens_per_step=512, **kw).best
    large = search(model, mem, Pinned(ALL_NVME), tokens_per_step=1024, **kw).best
    assert without is not None and small is not None and large is not None
    assert without.seconds_per_step < 1
    assert small.seconds_per_step == pytest.approx(6 * params * 512 / 1e6)
    assert large.seconds_per_step == pytest.approx(2 * small.seconds_per_step)


def test_a_step_that_runs_after_backward_adds_its_state_reads() -> None:
    """[Note: step time model]: without the overlap (or pipeline_read) the step's state reads
    run alone after the compute; with it they overlap."""
    bw = {**DEFAULT_BANDWIDTH, "flops": 1e9, "disk_read": 1e9}
    traffic = {"disk->host": 10**9, "host->disk": 0, "host->device": 0, "device->host": 0}
    overlapped = seconds_per_step(traffic, 0, bw, compute_flops=2e9)
    alone = seconds_per_step(traffic, 0, bw, compute_flops=2e9, step_disk_reads=10**9)
    assert overlapped == pytest.approx(2.0) and alone == pytest.approx(3.0)
    # the step's write-backs start while it still reads, on the same drive: in its alone part
    bw["disk_write"] = 0.5e9
    writes = {**traffic, "host->disk": 10**9}
    assert seconds_per_step(writes, 0, bw, compute_flops=2e9) == pytest.approx(3.0)  # hidden by nothing
    both = seconds_per_step(writes, 0, bw, compute_flops=2e9, step_disk_reads=10**9, step_disk_writes=10**9)
    assert both == pytest.approx(2.0 + 1.0 + 2.0)


def test_the_gpu_tiers_copies_on_a_host_without_gpu_take_the_computes_cores() -> None:
    """[Note: host rates measured]: where the "gpu" tier is host memory its copies are memcpy on
    the cores that compute, at the host copy rate; a GPU's copies overlap on their own link."""
    bw = {**DEFAULT_BANDWIDTH, "flops": 1e9, "host_copy": 1e9}
    traffic = {"disk->host": 0, "host->disk": 0, "host->device": 0, "device->host": 0}
    assert seconds_per_step(traffic, 0, bw, compute_flops=2e9, shared_cores=True, host_copies=10**9) == (
        pytest.approx(3.0)
    )
    assert seconds_per_step(traffic, 0, bw, compute_flops=2e9, host_copies=10**9) == pytest.approx(2.0)


def test_an_overlapped_step_moves_its_state_only_in_backward() -> None:
    """[Note: the overlapped step's two phases]: the forward overlaps the parameter gathers, not
    the optimizer state's I/O, which waits for backward's gradients; with buffer_count 1 each
    tile's Adam sits between its read and its write."""
    bw = {**DEFAULT_BANDWIDTH, "flops": 1e9, "disk_read": 1e9, "disk_write": 1e9, "cpu_adam": 1e9}
    traffic = {"disk->host": 9 * 10**9, "host->disk": 0, "host->device": 0, "device->host": 0}
    flops = 3e9  # 1 s of forward, 2 s of backward
    single_max = seconds_per_step(traffic, 0, bw, compute_flops=flops)
    assert single_max == pytest.approx(9.0)
    two = seconds_per_step(
        traffic, 0, bw, compute_flops=flops, state_in_backward=True, gather_disk_reads=10**8
    )
    assert two == pytest.approx(1.0 + 8.9)  # the forward's compute, then the rest of the I/O
    io_bound_forward = seconds_per_step(
        traffic, 0, bw, compute_flops=flops, state_in_backward=True, gather_disk_reads=2 * 10**9
    )
    assert io_bound_forward == pytest.approx(2.0 + 7.0)
    adam = 10**9  # 1 s
    kw = {"compute_flops": flops, "state_in_backward": True, "gather_disk_reads": 10**8}
    assert seconds_per_step(traffic, adam, bw, **kw) == pytest.approx(1.0 + 8.9)
    assert seconds_per_step(traffic, adam, bw, adam_in_io_chain=True, **kw) == pytest.approx(1.0 + 9.9)
    # compute-bound: the two phases add up to the whole compute (+ the Adam on shared cores)
    slow = {**bw, "flops": 1e8}
    assert seconds_per_step(traffic, adam, slow, shared_cores=True, **kw) == pytest.approx(30.0 + 1.0)
    assert forward_fraction() == pytest.approx(1 / 3)
    assert forward_fraction(checkpointing=True) == pytest.approx(1 / 4)
    assert forward_fraction(accumulation=2) == pytest.approx(1 - (2 / 3) / 2)


def test_the_search_weighs_the_overlapped_steps_phases_and_the_chained_adam(tmp_path: Path) -> None:
    """An I/O-bound overlapped step: buffer_count 1 costs its Adam on top of the I/O, 2 hides it,
    and the forward's compute is added; the step's figure is what seconds_per_step says of the
    candidate's own traffic."""
    model = _meta()
    mem = Memories(gpu=8 * 2**30, cpu=8 * 2**30, nvme=2**40)
    bw = {**DEFAULT_BANDWIDTH, "flops": 1e12, "disk_read": 1e8, "disk_write": 1e8, "cpu_adam": 1e9}
    kw = {"nvme_path": str(tmp_path), "bandwidth": bw, "device_kind": "cuda", "compute_flops": 3e6}
    kw["base"] = NO_RESIDENCY  # the state's disk I/O is the subject, not what the cpu tier keeps
    knobs = {**ALL_NVME, "sub_group_size": 1_000_000, "overlap_step": True, "max_in_cpu": 0}
    one = weigh(model, {**knobs, "buffer_count": 1}, mem, **kw)
    two = weigh(model, {**knobs, "buffer_count": 2}, mem, **kw)
    assert one.config["tiered"]["overlap_step_with_backward"] is True
    adam = sum(g.shard_numel for g in one.prediction.groups if g.trainable) / bw["cpu_adam"]
    assert one.seconds_per_step == pytest.approx(two.seconds_per_step + adam)
    # the search keeps the parameters in cpu (max_in_cpu from the room): no gather reads, so the
    # forward's compute comes before all of the disk I/O
    assert two.traffic["disk->host"] > 0 and two.knobs["max_in_cpu"] > 0
    disk = two.traffic["disk->host"] / 1e8 + two.traffic["host->disk"] / 1e8
    assert adam > 0 and two.seconds_per_step == pytest.approx(disk + 3e6 / 1e12 / 3, rel=1e-9)


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_plan_cli_counts_compute_with_tokens_and_a_flop_rate(capsys: pytest.CaptureFixture[str]) -> None:
    from tiered.cli.main import main

    args = ["plan", "--params", "1e9", "--gpu-mem", "80GB", "--cpu-mem", "64GB", "--nvme-mem", "1TB"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert "compute: not modelled (give --tokens-per-step or --seq-len" in plain
    assert main([*args, "--seq-len", "4096", "--micro-batch", "4", "--flops", "1e12"]) == 0
    out = capsys.readouterr().out
    assert "compute 1.000 TFLOP/s (--flops)" in out and "16,384 tokens per step x 6 FLOPs" in out
    seconds = float(out.split("predicted ")[1].split(" s/step")[0])
    assert seconds >= 6 * 1e9 * 16384 / 1e12 * 0.95  # at least the compute (the shape model: ~1e9 params)


def test_read_bandwidth_takes_the_compute_rate(tmp_path: Path) -> None:
    from tiered.planning.timing import read_bandwidth

    path = tmp_path / "bench.json"
    path.write_text('{"methods": [], "compute": {"flops_per_s": 2.5e12}}')
    bw, said = read_bandwidth(path)
    assert bw["flops"] == 2.5e12 and any("2.50 TFLOP/s" in s for s in said)
    path.write_text('{"methods": []}')
    assert "flops" not in read_bandwidth(path)[0]


def test_overlap_pinned_on_with_fp16_is_refused_by_name() -> None:
    from tiered.errors import ConfigError

    with pytest.raises(ConfigError, match="--overlap-step on.*fp16"):
        search(
            _meta(), Memories(gpu=2**30), Pinned({**ALL_NVME, "overlap_step": True}), base=plan_base("fp16")
        )


@pytest.mark.slow  # ~10 s or more on two cores: the default run stays under 15 minutes
def test_tiered_plan_estimates_the_activations_from_the_batch_and_leaves_them_the_room(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --activation-mem the plan does not fill the GPU with parameters it may need for
    activations; with --seq-len it estimates them ([Note: activation estimate], as `tiered
    finetune` checks) and sizes the live budget around them."""
    import json

    from tiered.cli.main import main

    folder = tmp_path / "m"
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    }  # 1.4B, fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    base = ["plan", "--model", str(folder), "--gpu-mem", "3GB", "--cpu-mem", "32GB", "--nvme-mem", "100GB"]
    flags = ["--offload-optimizer", "nvme", "--offload-param", "nvme"]
    lives = {}
    for name, extra in (
        ("unknown", []),
        ("estimated", ["--seq-len", "2048", "--checkpointing"]),
        ("declared", ["--activation-mem", "0"]),
    ):
        assert main([*base, *flags, *extra, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        lives[name] = doc["config"]["zero_optimization"].get("stage3_max_live_parameters")
        notes = " ".join(doc.get("assumed", []))
        if name == "unknown":
            assert "activations: not known" in notes
        if name == "estimated":
            assert "activations: ~" in notes and "per layer" in notes
    assert lives["unknown"] is None  # the default live budget: nothing gathered beyond ZeRO-3's need
    assert lives["declared"] > lives["estimated"] > 0  # the room, less the activations estimated


def test_the_text_plan_does_not_say_activations_are_not_counted_when_it_estimated_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tiered.cli.main import main

    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    base = ["plan", "--model", str(tmp_path), "--gpu-mem", "1GiB", "--cpu-mem", "4GiB", "--flops", "1e12"]
    main([*base, "--seq-len", "16"])
    out = capsys.readouterr().out
    assert "activations: NOT counted" not in out and "count their estimate" in out
    assert "activations: ~" in out  # the estimate itself, among the assumptions
    main(base)
    assert "activations: NOT counted" in capsys.readouterr().out  # no batch given: nothing to estimate
