"""The memories of the machine a run starts on: what `tiered finetune` plans with when no config
is given ([Note: the machine is the default]).

[Note: the machine is the default]
Without ``--config`` (or with one that leaves the memory layout to the planner, ``--auto-config``
without memories), `tiered finetune` plans from what this machine has, per rank of the host:

* GPU: the device's free memory now (CUDA), none on a machine without one (the compute and the
  "gpu" tier are then host memory, counted in the host's figure);
* host: what the kernel could give now (MemAvailable, within a container's limit:
  `tiered.device.host_mem_info`) less what the system keeps for itself: a tenth of the memory,
  at least 2 GiB (`tiered.planning.residency.implicit_reserve_bytes`, the reserve a cpu tier
  without a budget keeps too);
* NVMe: the free space of the offload folder's filesystem (its nearest existing parent).

Those memories go to the search of [Note: config search] as a user's ``--auto-config`` would,
the fastest config that fits is trained, and one block says what was found and chosen
(`describe`). A memory the user gives (``--auto-config cpu_mem=...``) is taken instead of the
machine's.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tiered.device import host_mem_info
from tiered.planning.residency import implicit_reserve_bytes
from tiered.units import format_bytes


@dataclass(frozen=True)
class MachineMemories:
    """What this machine has for one rank, and where each figure came from."""

    gpu_bytes: int | None
    cpu_bytes: int | None
    nvme_bytes: int | None
    said: tuple[str, ...]
    """One line per memory: the reading it came from."""

    def auto_config(self) -> dict[str, int]:
        """As ``tiered.auto_config``'s memories (the keys left out where the machine could not tell)."""
        out = {"gpu_mem": self.gpu_bytes, "cpu_mem": self.cpu_bytes, "nvme_mem": self.nvme_bytes}
        return {k: int(v) for k, v in out.items() if v is not None}


def _existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def machine_memories(
    offload_dir: str | os.PathLike[str], *, cuda: bool, local_ranks: int = 1
) -> MachineMemories:
    """This machine's memories for one of its `local_ranks` ranks ([Note: the machine is the default])."""
    ranks = max(1, int(local_ranks))
    said = []
    gpu = None
    if cuda:
        import torch

        free, size = torch.cuda.mem_get_info()
        gpu = int(free)
        said.append(
            f"GPU: {format_bytes(free)} free of {format_bytes(size)} ({torch.cuda.get_device_name()})"
        )
    else:
        said.append("GPU: none (the compute and the gpu tier use host memory)")
    avail, total = host_mem_info()
    cpu = None
    if avail is not None:
        reserve = implicit_reserve_bytes(total)
        cpu = max(0, avail - reserve) // ranks
        said.append(
            f"host: {format_bytes(avail)} available of {format_bytes(total or 0)}, less {format_bytes(reserve)} "
            f"kept for the system"
            + (f", shared by {ranks} ranks" if ranks > 1 else "")
            + f": {format_bytes(cpu)}"
        )
    else:
        said.append("host: this system does not say how much memory is available (not checked)")
    where = _existing(Path(offload_dir))
    nvme = shutil.disk_usage(where).free // ranks
    said.append(
        f"NVMe: {format_bytes(nvme)} free at {where}" + (f" (per rank of {ranks})" if ranks > 1 else "")
    )
    return MachineMemories(gpu, cpu, nvme, tuple(said))
