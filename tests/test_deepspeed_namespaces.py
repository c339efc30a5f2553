"""The ``deepspeed`` name and the namespaces DeepSpeed scripts import, without DeepSpeed:
the import alias ([Note: deepspeed as an alias of tiered.deepspeed]), ``ops.adam``,
``runtime.lr_schedules``, ``checkpointing``, ``accelerator``, ``comm``, and the features tiered
refuses ([Note: refused DeepSpeed features])."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import no_leftover_process_group  # noqa: F401 - the fixture
from torch import nn

import tiered.deepspeed as deepspeed
from tiered.errors import UnsupportedConfigError, UnsupportedFeatureError

ROOT = Path(__file__).resolve().parents[1]


def fresh_python(
    code: str, tmp_path: Path, extra_path: list[Path] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(p) for p in [*(extra_path or []), ROOT, ROOT / "plugins"]),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_swap_then_deepspeed_imports_are_tiereds(tmp_path: Path) -> None:
    proc = fresh_python(
        """
        import importlib.util, sys
        assert importlib.util.find_spec("deepspeed") is None or "tiered" in importlib.util.find_spec("deepspeed").origin
        import tiered.deepspeed as deepspeed
        from deepspeed import comm
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
        from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam as C2
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, GatheredParameters
        from deepspeed.runtime.lr_schedules import WarmupLR
        from deepspeed.utils import logger, log_dist, safe_get_full_fp32_param
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        import deepspeed as again
        assert again is deepspeed is sys.modules["deepspeed"]
        assert comm is dist is deepspeed.comm is sys.modules["tiered.deepspeed.comm"]
        assert get_accelerator is deepspeed.accelerator.get_accelerator and C2 is DeepSpeedCPUAdam
        assert GatheredParameters is deepspeed.zero.GatheredParameters
        assert deepspeed.checkpointing is sys.modules["tiered.deepspeed.runtime.activation_checkpointing.checkpointing"]
        try:
            import deepspeed.ops.transformer
        except ModuleNotFoundError as e:
            assert e.name == "deepspeed.ops.transformer" and "tiered" in str(e)
        else:
            raise AssertionError("no error")
        print("ok")
        """,
        tmp_path,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_deepspeeds_own_package_imported_first_keeps_its_name(tmp_path: Path) -> None:
    """A process that imported DeepSpeed before tiered.deepspeed keeps DeepSpeed's modules (with
    a warning): replacing modules a script already holds would split its state."""
    fake = tmp_path / "site" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    (fake / "comm.py").write_text("REAL_COMM = True\n")
    proc = fresh_python(
        """
        import deepspeed
        import tiered.deepspeed
        from deepspeed import comm
        import sys
        assert sys.modules["deepspeed"].REAL and comm.REAL_COMM
        print("kept")
        """,
        tmp_path,
        [tmp_path / "site"],
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "kept", proc.stderr[-3000:]
    assert "DeepSpeed's own package" in proc.stderr and "tiered run" in proc.stderr


def test_the_shim_folder_makes_a_fresh_interpreters_deepspeed_tiereds(tmp_path: Path) -> None:
    from tiered.cli.run_plan import shim_dir

    proc = fresh_python(
        """
        import deepspeed.comm as dist
        from deepspeed.runtime.engine import DeepSpeedEngine
        import sys, tiered.deepspeed, tiered.engine
        assert sys.modules["deepspeed"] is tiered.deepspeed and dist is tiered.deepspeed.comm
        assert DeepSpeedEngine is tiered.deepspeed.DeepSpeedEngine  # the adapter around tiered.engine.Engine
        from transformers.integrations import is_deepspeed_available
        print(is_deepspeed_available())
        """,
        tmp_path,
        [shim_dir()],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no DeepSpeed distribution is installed: libraries probing for one still see none
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize(
    "use,feature",
    [
        (lambda: deepspeed.PipelineModule(layers=[]), "pipeline parallelism"),
        (lambda: deepspeed.PipelineEngine(), "pipeline parallelism"),
        (lambda: deepspeed.pipe, "pipeline parallelism"),
        (lambda: __import__("deepspeed.pipe"), "pipeline parallelism"),
        (lambda: __import__("deepspeed.runtime.pipe.engine"), "pipeline parallelism"),
        (lambda: deepspeed.init_inference(nn.Linear(2, 2)), "DeepSpeed-Inference"),
        (lambda: deepspeed.InferenceEngine(), "DeepSpeed-Inference"),
        (lambda: __import__("deepspeed.inference.engine"), "DeepSpeed-Inference"),
        (lambda: deepspeed.tp_model_init(nn.Linear(2, 2), tp_size=2), "tensor parallelism"),
        (lambda: __import__("deepspeed.module_inject"), "tensor parallelism"),
        (lambda: deepspeed.checkpointing.get_cuda_rng_tracker(), "tensor parallelism"),
        (lambda: __import__("deepspeed.sequence.layer"), "sequence parallelism"),
    ],
)
def test_what_tiered_lacks_is_refused_by_name_with_the_alternative(use: Any, feature: str) -> None:
    with pytest.raises(
        UnsupportedFeatureError, match=rf"tiered does not implement {feature}.*Instead: "
    ) as info:
        use()
    assert isinstance(info.value, ImportError) and isinstance(info.value, UnsupportedConfigError)


def test_refused_classes_still_answer_isinstance() -> None:
    assert not isinstance(nn.Linear(2, 2), deepspeed.PipelineModule)
    assert isinstance(deepspeed.DeepSpeedEngine, type)


# ---- ops.adam ---------------------------------------------------------------------------------


def _train_steps(opt_factory: Any, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = opt_factory(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "ours,torchs",
    [
        (
            lambda p: deepspeed.ops.adam.DeepSpeedCPUAdam(p, lr=0.01, weight_decay=0.1),
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        ),
        (
            lambda p: deepspeed.ops.adam.DeepSpeedCPUAdam(p, lr=0.01, weight_decay=0.1, adamw_mode=False),
            lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
        ),
        (
            lambda p: deepspeed.ops.adam.FusedAdam(p, lr=0.01, weight_decay=0.1),
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        ),
        (
            lambda p: deepspeed.ops.adam.FusedAdam(p, lr=0.01, weight_decay=0.1, adam_w_mode=False),
            lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
        ),
    ],
    ids=["cpu_adamw", "cpu_adam_l2", "fused_adamw", "fused_adam_l2"],
)
def test_deepspeeds_adam_classes_step_as_torchs(ours: Any, torchs: Any) -> None:
    for a, b in zip(_train_steps(ours), _train_steps(torchs), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_deepspeeds_adam_arguments_tiered_would_not_honour_are_refused() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(UnsupportedConfigError, match="amsgrad"):
        deepspeed.ops.adam.DeepSpeedCPUAdam(p, amsgrad=True)
    with pytest.raises(UnsupportedConfigError, match="bias_correction"):
        deepspeed.ops.adam.FusedAdam(p, bias_correction=False)
    with pytest.raises(UnsupportedConfigError, match="fp32_optimizer_states"):
        deepspeed.ops.adam.DeepSpeedCPUAdam(p, fp32_optimizer_states=False)


@pytest.mark.usefixtures("no_leftover_process_group")
@pytest.mark.parametrize("cls", ["DeepSpeedCPUAdam", "FusedAdam"])
def test_a_client_deepspeed_adam_trains_as_torch_adamw(cls: str) -> None:
    """Passed to initialize (as the SuperOffload script does), DeepSpeed's Adam becomes tiered's
    offloaded Adam with its hyper-parameters: the same weights as torch AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())
    opt = getattr(deepspeed.ops.adam, cls)(model.parameters(), lr=0.01, weight_decay=0.1)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            ref_opt.zero_grad()
            ref_loss = nn.functional.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.allclose(deepspeed.utils.safe_get_full_fp32_param(p), q.detach(), atol=1e-6, rtol=0)
        assert p.ds_numel == q.numel() and p.ds_shape == q.shape and p.ds_tensor.numel() == q.numel()
    finally:
        engine.close()


# ---- runtime.lr_schedules -------------------------------------------------------------------


def _deepspeed_warmup(i: int, lo: float, hi: float, w: int, kind: str) -> float:
    """DeepSpeed 0.19.8's WarmupLR.get_lr() at last_batch_iteration i, written out."""
    w = max(2, w)
    if i < 0:
        return lo
    if i < w:
        gamma = math.log(i + 1) / math.log(w) if kind == "log" else i / w
    else:
        gamma = 1.0
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_writes_deepspeeds_lrs_into_each_group(kind: str) -> None:
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=1.0)
    s = deepspeed.runtime.lr_schedules.WarmupLR(
        opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5], warmup_num_steps=5, warmup_type=kind
    )
    for steps in range(8):  # after `steps` calls of step(), DeepSpeed's last_batch_iteration is steps - 1
        want = [_deepspeed_warmup(steps - 1, lo, hi, 5, kind) for lo, hi in ((0.0, 1.0), (0.1, 0.5))]
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(want)
        assert s.get_last_lr() == pytest.approx(want)
        s.step()
    assert s.state_dict() == {"last_batch_iteration": 7}


def test_warmup_decay_and_cosine_follow_deepspeeds_formulas() -> None:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    decay = deepspeed.runtime.lr_schedules.WarmupDecayLR(
        opt, total_num_steps=10, warmup_max_lr=0.2, warmup_num_steps=4, warmup_type="linear"
    )
    got = []
    for _ in range(12):
        decay.step()
        got.append(opt.param_groups[0]["lr"])
    want = [0.2 * (i / 4) if i < 4 else 0.2 * max(0.0, (10 - i) / 6) for i in range(12)]
    assert got == pytest.approx(want)
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    cos = deepspeed.runtime.lr_schedules.WarmupCosineLR(
        opt2, total_num_steps=10, warmup_num_steps=2, cos_min_ratio=0.1, warmup_type="linear"
    )
    assert opt2.param_groups[0]["lr"] == 0.0  # DeepSpeed's ratio before the first step
    lrs = []
    for _ in range(10):
        cos.step()
        lrs.append(opt2.param_groups[0]["lr"])
    assert lrs[:2] == pytest.approx([0.0, 0.5 * 0.5]) and lrs[-1] == pytest.approx(0.5 * 0.1)
    with pytest.raises(UnsupportedConfigError, match="OneCycle"):
        deepspeed.runtime.lr_schedules.OneCycle(opt2, cycle_min_lr=0.0, cycle_max_lr=1.0)


@pytest.mark.usefixtures("no_leftover_process_group")
def test_a_client_warmup_lr_drives_the_engine_as_the_config_section_does() -> None:
    """WarmupLR built by the script on its optimizer and passed to initialize gives the lrs of
    the same schedule as a config ``scheduler`` section."""
    lrs: dict[str, list[float]] = {}
    for how in ("client", "config"):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 3, "warmup_type": "linear"}
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if how == "client":
            sched = deepspeed.runtime.lr_schedules.WarmupLR(opt, **params)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
        else:
            cfg["scheduler"] = {"type": "WarmupLR", "params": params}
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        try:
            seen = []
            for _ in range(5):
                engine.backward(engine(torch.ones(2, 4)).sum())
                engine.step()
                seen.append(engine.get_lr()[0])
            lrs[how] = seen
        finally:
            engine.close()
    assert lrs["client"] == pytest.approx(lrs["config"]) and len(set(lrs["client"])) > 1


# ---- checkpointing, accelerator, comm -----------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self, checkpoint: Any) -> None:
        super().__init__()
        self.a, self.b, self.head = Block(), Block(), nn.Linear(8, 1)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in (self.a, self.b):
            x = self.checkpoint(block, x) if self.checkpoint else block(x)
        return self.head(x).sum()


@pytest.mark.usefixtures("no_leftover_process_group")
@pytest.mark.parametrize("which", ["checkpoint", "non_reentrant_checkpoint"])
def test_activation_checkpointing_recomputes_with_the_same_dropout(which: str) -> None:
    """deepspeed.checkpointing.checkpoint on ZeRO-3-partitioned blocks with dropout: the same
    losses and weights as without checkpointing (the RNG state is restored for the recompute)."""
    deepspeed.checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    assert deepspeed.checkpointing.is_configured()
    runs = {}
    for ck in (None, getattr(deepspeed.checkpointing, which)):
        torch.manual_seed(0)
        model = Net(ck)
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        }
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        try:
            torch.manual_seed(5)
            losses = []
            for _ in range(3):
                # requires_grad: a reentrant checkpoint gives the block's parameters gradients only
                # through an input that requires one (torch's and DeepSpeed's alike)
                loss = engine(torch.randn(4, 8, requires_grad=True))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            runs[ck is None] = (
                losses,
                [deepspeed.utils.safe_get_full_fp32_param(p) for p in model.parameters()],
            )
        finally:
            engine.close()
    assert runs[True][0] == pytest.approx(runs[False][0], abs=1e-6)
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_checkpointing_options_that_would_change_behaviour_are_refused() -> None:
    with pytest.raises(UnsupportedConfigError, match="cpu_checkpointing"):
        deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    with pytest.raises(UnsupportedFeatureError, match="tensor parallelism"):
        deepspeed.checkpointing.configure(object())


def test_the_accelerator_answers_what_scripts_ask() -> None:
    acc = deepspeed.accelerator.get_accelerator()
    assert acc.device_name() == "cpu" and acc.current_device_name() == "cpu" and acc.is_available()
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported()
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed_all(3)
    assert torch.equal(a, torch.rand(2)) and acc.initial_seed() == 3
    acc.synchronize()
    acc.empty_cache()
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() > 0
    assert acc.total_memory() > acc.available_memory() > 0 and isinstance(acc.memory_stats(), dict)
    acc.reset_peak_memory_stats()
    assert acc.FloatTensor([1.0]).dtype == torch.float32 and torch.float32 in acc.supported_dtypes()
    state = acc.get_rng_state()
    x = torch.rand(1)
    acc.set_rng_state(state)
    assert torch.equal(x, torch.rand(1))
    with acc.stream(acc.current_stream()):
        pass
    with pytest.raises(UnsupportedConfigError, match="tiered build-ext"):
        acc.create_op_builder("CPUAdamBuilder")


@pytest.mark.usefixtures("no_leftover_process_group")
def test_comm_collectives_on_one_process() -> None:
    deepspeed.init_distributed()
    try:
        dist = deepspeed.comm
        t = torch.arange(4.0)
        out = [torch.zeros(4)]
        dist.all_gather(out, t)
        assert torch.equal(out[0], t)
        objs: list[Any] = [None]
        dist.all_gather_object(objs, {"a": 1})
        assert objs == [{"a": 1}]
        lst: list[Any] = ["x"]
        dist.broadcast_object_list(lst, 0)
        gathered = [torch.zeros(4)]
        dist.gather(t, gathered, dst=0)
        assert torch.equal(gathered[0], t)
        got = torch.zeros(4)
        dist.scatter(got, [t], src=0)
        assert torch.equal(got, t)
        rs = torch.zeros(4)
        dist.reduce_scatter_tensor(rs, t.clone())
        assert torch.equal(rs, t)
        assert (
            dist.get_all_ranks_from_group(dist.get_world_group()) == [0]
            and dist.get_global_rank(None, 0) == 0
        )
        assert dist.get_all_ranks_from_group() == []  # DeepSpeed's answer for group=None
        assert dist.get_backend() == "gloo" and dist.get_world_group() is not None
        dist.monitored_barrier()
        dist.log_summary()
    finally:
        deepspeed.comm.destroy_process_group()


@pytest.mark.usefixtures("no_leftover_process_group")
def test_load_checkpoint_without_latest_returns_none_none_as_deepspeed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSpeed's answer for a folder with no ``latest``: ``(None, None)`` and a warning; an
    explicit tag that is not there still raises."""
    from tiered.errors import CheckpointNotFoundError

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=cfg)
    try:
        assert engine.load_checkpoint(tmp_path / "missing") == (None, None)
        assert "Unable to find latest file" in caplog.text
        (tmp_path / "empty").mkdir()
        assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
        with pytest.raises(CheckpointNotFoundError):
            engine.load_checkpoint(tmp_path / "empty", tag="nope")
        engine.backward(engine(torch.ones(2, 3)).sum())
        engine.step()
        engine.save_checkpoint(tmp_path / "ck")
        path, _ = engine.load_checkpoint(tmp_path / "ck")
        assert path is not None
    finally:
        engine.close()
