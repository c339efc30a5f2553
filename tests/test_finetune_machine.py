"""`tiered finetune` without --config: planned from this machine's memories ([Note: the machine is
the default])."""

from __future__ import annotations

from pathlib import Path

import pytest
from finetune_support import write_model

from tiered.cli.main import main
from tiered.planning import machine
from tiered.planning.residency import implicit_reserve_bytes


def _job(tmp_path: Path) -> list[str]:
    model = write_model(tmp_path / "m")
    data = tmp_path / "d.txt"
    data.write_text("the fast place is small, the slow place is big. " * 20)
    return ["finetune", "--model", str(model), "--data", str(data), "--seq-len", "16", "--steps", "2",
            "--nvme-path", str(tmp_path / "offload")]  # fmt: skip


def test_no_config_plans_from_the_machine_and_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_job(tmp_path), "--lr", "1e-3"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    block = out.split("model: ")[0]
    assert "no --config: planned from this machine" in block
    for memory in ("GPU: ", "host: ", "NVMe: ", "chosen: "):
        assert f"\n  {memory}" in block, block
    assert "kept for the system" in block and "the fastest predicted config of those that fit" in block
    assert "step     2/2" in out and "lr 0.001" in out
    # the chosen config puts nothing on NVMe here (a tiny model): no empty --nvme-path folder is
    # left behind by the candidates the planner weighed ([Note: config parsing is pure])
    assert "nvme" not in block.split("chosen: ")[1].split("\n")[0], block
    assert not (tmp_path / "offload").exists()


def test_no_config_needs_a_learning_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_job(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "--lr is required without --config" in err and "never chooses a learning rate" in err


def test_the_users_memories_are_taken_over_the_machines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_job(tmp_path), "--lr", "1e-3", "--auto-config", "cpu_mem=40MB"]) == 2
    captured = capsys.readouterr()
    assert "--auto-config cpu_mem=40MB (taken over the machine's figures)" in captured.out
    assert "nothing fits the memory given (--auto-config cpu_mem 38.15 MiB" in captured.err
    assert not (tmp_path / "offload").exists(), "a refused config left its --nvme-path folder"


def test_the_machines_memories_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(machine, "host_mem_info", lambda: (100 * gib, 128 * gib))
    one = machine.machine_memories(tmp_path / "not" / "yet", cuda=False)
    two = machine.machine_memories(tmp_path, cuda=False, local_ranks=2)
    reserve = implicit_reserve_bytes(128 * gib)  # a tenth of the memory here
    assert reserve == int(12.8 * gib)
    assert one.cpu_bytes == 100 * gib - reserve and two.cpu_bytes == (100 * gib - reserve) // 2
    assert one.gpu_bytes is None and "gpu_mem" not in one.auto_config()
    assert one.nvme_bytes is not None and two.nvme_bytes is not None
    assert abs(two.nvme_bytes - one.nvme_bytes // 2) < 2**26  # the same filesystem (nearest existing parent)
    assert one.auto_config() == {"cpu_mem": one.cpu_bytes, "nvme_mem": one.nvme_bytes}
    monkeypatch.setattr(machine, "host_mem_info", lambda: (None, None))
    blind = machine.machine_memories(tmp_path, cuda=False)
    assert blind.cpu_bytes is None and "not checked" in blind.said[1]
