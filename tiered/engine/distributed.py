"""The process group under torchrun: set up from the environment when nobody else did.

[Note: process group from torchrun]
torchrun (torch.distributed.run) starts each rank with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in its environment. With WORLD_SIZE > 1 and no process group yet,
`tiered.initialize` and `tiered finetune` call `ensure_process_group`: it binds the rank to its
CUDA device (LOCAL_RANK) when CUDA is there, and initialises the default group with env://
(NCCL on CUDA, gloo on CPU), as DeepSpeed's `init_distributed` does. A WORLD_SIZE > 1 without the
rest of torchrun's variables is not a launch tiered can complete: that is an error naming
`torch.distributed.init_process_group`, because training on silently would run independent
replicas. An already initialised group is used as it is (the caller chose it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from tiered.errors import ConfigError, DistributedSetupError

log = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_world_size(env: Mapping[str, str] | None = None) -> int:
    """WORLD_SIZE of the environment (1 when unset); a non-integer is a ConfigError."""
    env = os.environ if env is None else env
    raw = env.get("WORLD_SIZE", "").strip()
    if not raw:
        return 1
    try:
        world = int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment is not an integer") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} in the environment must be >= 1")
    return world


def ensure_process_group(backend: str | None = None) -> bool:
    """Initialise the default process group from torchrun's environment when WORLD_SIZE > 1 and
    none exists ([Note: process group from torchrun]); True when this call created it.

    `backend` overrides the choice (NCCL with CUDA, else gloo), as DeepSpeed's `dist_backend=`."""
    world = env_world_size()
    if world == 1 or (dist.is_available() and dist.is_initialized()):
        return False
    missing = [k for k in TORCHRUN_VARS if not os.environ.get(k, "").strip()]
    if missing or not dist.is_available():
        why = f"{', '.join(missing)} unset" if missing else "this torch has no torch.distributed"
        raise DistributedSetupError(
            f"WORLD_SIZE={world} in the environment but no process group ({why}): launch with torchrun "
            "(python -m torch.distributed.run --nproc_per_node N ...), or call "
            "torch.distributed.init_process_group before tiered.initialize; otherwise every "
            "process would train its own replica"
        )
    chosen = "gloo"
    device_id = None
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible"
            )
        torch.cuda.set_device(local)
        chosen, device_id = "nccl", torch.device("cuda", local)
    backend = backend or chosen
    if backend != "nccl":
        device_id = None  # a device binding is an NCCL notion
    dist.init_process_group(backend=backend, init_method="env://", device_id=device_id)
    log.info("process group: %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return True
