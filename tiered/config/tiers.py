"""The `"tiered"` section: tiers (a backend spec and a byte budget each), and where offload goes.

[Note: default tiers]
Whatever the user writes, the resolved config has a "gpu" tier ({"type": "gpu"}) and a "cpu" tier
({"type": "cpu"}, pinned host memory; ``"pin_memory": false`` when an active offload section sets
pin_memory false), each with budget None (= what the backend reports free).
An "nvme" tier is derived when an offload device is "nvme":
``{"type": "nvme", "path": <nvme_path>, "block_size": aio.block_size, "queue_depth":
aio.queue_depth, "thread_count": aio.thread_count, "atomic": false, "fsync": false, "swap": true,
"create": true}``
(plus ``"use_gds": true`` when set): offload swap files are overwritten in place and never synced, as
DeepSpeed's swapper does (the nvme backend's [Note: nvme scratch mode]), and live in a per-process
directory under nvme_path that closing the engine deletes, a crashed run's being reclaimed by the
next (the nvme backend's [Note: nvme swap directories]). A tier the user declares with their own
backend spec (another name, its own directory) gets none of these keys: its files persist.
When offload_param and offload_optimizer both use NVMe with *different* nvme_path values (DeepSpeed
allows one drive for each), parameters go to tier "nvme" and optimizer state to a second tier
"nvme_optimizer" with the optimizer's path, so the two streams keep their own drives.
`TieredSection.param_tier` / `optimizer_tier` record which tier holds offloaded parameters /
optimizer state ("cpu", "nvme", "nvme_optimizer"; None when that offload is off). A user may point
them at a custom tier (e.g. a tensorstore backend) with ``"tiered": {"optimizer_tier": "remote"}``.
A tier the user lists without a "backend" gets the derived one; a user "nvme" backend for an
offload tier gets the derived keys it leaves out (aio knobs, scratch mode, swap; set
``"swap": false`` there to keep the files after close); one whose "path" contradicts the offload
nvme_path is an error, not a silent choice between the two.
Backend specs stay plain JSON dicts: the registry opens them (and the backend validates its own
keys then); config never imports plugins.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from tiered.config.keys import check_section, is_comment, unknown_key_error
from tiered.config.read import read_key, read_keys
from tiered.config.schema import OPTIMIZER_STATE_FORMATS, AioConfig, TieredSection, TierSpec, ZeroConfig
from tiered.config.values import as_section, as_str, is_auto
from tiered.errors import ConfigError
from tiered.units import parse_bytes

_TIER_KEYS = ("backend", "budget")


def _same_path(a: str, b: str) -> bool:
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def _derived_tiers(
    zero: ZeroConfig, aio: AioConfig
) -> tuple[dict[str, dict[str, Any]], str | None, str | None]:
    """Default backend specs, and the default param / optimizer tier names."""
    backends: dict[str, dict[str, Any]] = {"gpu": {"type": "gpu"}, "cpu": {"type": "cpu"}}
    # offload_*.pin_memory: the "cpu" tier is the one host pool both offloads use, so it is
    # pageable if any active offload asks for that (people turn pinning off for ulimit -l or
    # host OOM, [Note: default tiers]); the cpu backend pins only where CUDA is present.
    if any(o.device != "none" and not o.pin_memory for o in (zero.offload_param, zero.offload_optimizer)):
        backends["cpu"]["pin_memory"] = False

    def nvme_backend(path: str) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "type": "nvme",
            "path": path,
            "block_size": aio.block_size_bytes,
            "queue_depth": aio.queue_depth,
            "thread_count": aio.thread_count,
            # swap files, not checkpoints: overwrite in place, no fsync (see the nvme backend's
            # [Note: nvme scratch mode]; the tier manager never reads a half-written copy), and
            # nothing left on the user's drive after close or a crash ([Note: nvme swap directories])
            "atomic": False,
            "fsync": False,
            "swap": True,
            # the folder is made when the backend opens it, not while the config is parsed
            # ([Note: config parsing is pure] in loader.py)
            "create": True,
        }
        if aio.use_gds:
            spec["use_gds"] = True
        return spec

    param, opt = zero.offload_param, zero.offload_optimizer
    param_path = param.nvme_path if param.device == "nvme" else None
    opt_path = opt.nvme_path if opt.device == "nvme" else None
    split = param_path is not None and opt_path is not None and not _same_path(param_path, opt_path)
    if param_path is not None or opt_path is not None:
        backends["nvme"] = nvme_backend(param_path if param_path is not None else opt_path)  # type: ignore[arg-type]
    if split:
        backends["nvme_optimizer"] = nvme_backend(opt_path)  # type: ignore[arg-type]
    param_tier = {"none": None, "cpu": "cpu", "nvme": "nvme"}[param.device]
    opt_tier = {"none": None, "cpu": "cpu", "nvme": "nvme_optimizer" if split else "nvme"}[opt.device]
    return backends, param_tier, opt_tier


def derived_tier_names(zero: ZeroConfig, aio: AioConfig) -> set[str]:
    """The tiers every config gets or the offload devices derive ("gpu", "cpu", "nvme", ...):
    the others in ``tiered.tiers`` were declared by the user and must receive offload."""
    return set(_derived_tiers(zero, aio)[0])


def _backend(raw: Any, path: str, derived: dict[str, Any] | None) -> dict[str, Any]:
    spec = dict(as_section(raw, path))
    if "type" not in spec:
        raise ConfigError(f'{path}.type is missing; name a registered backend, e.g. "cpu", "nvme"')
    spec["type"] = as_str(spec["type"], f"{path}.type")
    if derived is not None and derived.get("type") == "nvme" and spec["type"] == "nvme":
        user_path = spec.get("path")
        if user_path is not None and not _same_path(str(user_path), derived["path"]):
            raise ConfigError(
                f"{path}.path = {user_path!r} contradicts the offload nvme_path {derived['path']!r}; "
                "make them equal or drop one"
            )
        # keys the user left out come from the offload-derived spec (aio knobs, scratch mode)
        spec = {**derived, **spec}
    return spec


def parse_tiered(raw: Any, zero: ZeroConfig, aio: AioConfig) -> tuple[TieredSection, bool]:
    """The resolved section, and tiered.overlap_step_with_backward (which lives in ZeroConfig)."""
    section = as_section(raw if raw is not None else {}, "tiered")
    check_section(section, "tiered")
    if section.get("auto_config") is not None:  # [Note: auto config]: it needs the model
        raise ConfigError(
            "tiered.auto_config is resolved where the model is known: pass the config to "
            "tiered.initialize(model, config) or tiered finetune, or resolve it first with "
            "tiered.planning.auto.resolve_auto_config(config, model)"
        )
    derived, param_tier, opt_tier = _derived_tiers(zero, aio)

    tiers: dict[str, TierSpec] = {}
    user_tiers = as_section(section.get("tiers") or {}, "tiered.tiers")
    for name, tier_raw in user_tiers.items():
        path = f"tiered.tiers.{name}"
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"tiered.tiers: tier names must be non-empty strings, got {name!r}")
        tier = as_section(tier_raw, path)
        for key in tier:
            if key not in _TIER_KEYS and not is_comment(key):
                raise unknown_key_error(path, key, _TIER_KEYS)
        if "backend" in tier:
            backend = _backend(tier["backend"], f"{path}.backend", derived.get(name))
        elif name in derived:
            backend = dict(derived[name])
        else:
            raise ConfigError(
                f"{path}.backend is missing; a custom tier needs a backend spec such as "
                '{"type": "tensorstore", ...} (see `tiered backends`)'
            )
        budget = tier.get("budget")
        budget_bytes = (
            None if budget is None or is_auto(budget) else parse_bytes(budget, what=f"{path}.budget")
        )
        tiers[name] = TierSpec(backend=backend, budget_bytes=budget_bytes)
    for name, backend in derived.items():
        tiers.setdefault(name, TierSpec(backend=dict(backend)))

    for key, device, what in (
        ("param_tier", zero.offload_param.device, "offload_param"),
        ("optimizer_tier", zero.offload_optimizer.device, "offload_optimizer"),
    ):
        if section.get(key) is None:
            continue
        name = as_str(section[key], f"tiered.{key}")
        if device == "none":
            raise ConfigError(
                f'tiered.{key} = {name!r} but zero_optimization.{what}.device is "none"; '
                f"set the offload device or remove tiered.{key}"
            )
        if name not in tiers:
            raise ConfigError(
                f"tiered.{key} = {name!r} names no tier; defined tiers: {', '.join(sorted(tiers))}"
            )
        if key == "param_tier":
            param_tier = name
        else:
            opt_tier = name

    grad_tier = None
    if section.get("grad_tier") is not None:  # [Note: gradients on nvme]
        grad_tier = as_str(section["grad_tier"], "tiered.grad_tier")
        if zero.offload_optimizer.device == "none":
            raise ConfigError(
                f'tiered.grad_tier = {grad_tier!r} but zero_optimization.offload_optimizer.device is "none" '
                "(gradients then stay in gpu with the optimizer); offload the optimizer or remove tiered.grad_tier"
            )
        if grad_tier not in tiers or grad_tier == "gpu":
            raise ConfigError(
                f"tiered.grad_tier = {grad_tier!r} names no offload tier; defined tiers: "
                f"{', '.join(sorted(t for t in tiers if t != 'gpu'))}"
            )
    trace_path = section.get("trace_path")
    t = TieredSection
    return TieredSection(
        tiers=tiers,
        trace_path=None if trace_path is None else as_str(trace_path, "tiered.trace_path"),
        **read_keys(
            section,
            t,
            "timeout_s",
            "io_threads",
            "verify_checksums",
            "io_timeout_floor_s",
            "io_min_bytes_per_s",
            "io_retries",
            "io_retry_backoff_s",
            "check_collective_order",
        ),
        io_retry_errnos=_errno_names(section.get("io_retry_errnos")),
        host_mmap_threshold=(
            _mmap_threshold(section["host_mmap_threshold"])
            if "host_mmap_threshold" in section
            else t.host_mmap_threshold
        ),
        param_tier=param_tier,
        optimizer_tier=opt_tier,
        grad_tier=grad_tier,
        optimizer_state_format=_state_format(section.get("optimizer_state_format")),
        nonfinite_step=_nonfinite_step(section.get("nonfinite_step")),
        residency=_residency(section.get("residency")),
    ), read_key(section, ZeroConfig, "overlap_step_with_backward")


NONFINITE_STEPS = ("raise", "skip", "apply")
RESIDENCY_MODES = ("auto", "host", "off")


def _residency(value: Any) -> str:
    """tiered.residency ([Note: residency] in tiered/planning/residency.py); absent or null: "auto"."""
    if value is None:
        return TieredSection.residency
    if value is False:
        return "off"
    if value not in RESIDENCY_MODES:
        raise ConfigError(
            f'tiered.residency = {value!r}: expected "auto" (the faster tiers keep what their budgets '
            'have room for across steps), "host" (only host memory does; the GPU\'s room is left to the '
            'activations) or "off" (every partition lives in its home between uses)'
        )
    return str(value)


def _nonfinite_step(value: Any) -> str | None:
    """tiered.nonfinite_step: [Note: non-finite steps] in tiered/engine/nonfinite.py."""
    if value is None:
        return None
    if value not in NONFINITE_STEPS:
        raise ConfigError(
            f"tiered.nonfinite_step = {value!r}: expected one of {', '.join(map(repr, NONFINITE_STEPS))} "
            '("raise": stop with an error naming the step; "skip": skip the step with a WARNING; '
            '"apply": apply it as plain PyTorch does)'
        )
    return str(value)


def _state_format(value: Any) -> str:
    """tiered.optimizer_state_format: one of OPTIMIZER_STATE_FORMATS ([Note: compressed optimizer
    state] in tiered/optim/state_format.py); absent or null: "fp32"."""
    if value is None:
        return TieredSection.optimizer_state_format
    if value not in OPTIMIZER_STATE_FORMATS:
        raise ConfigError(
            f"tiered.optimizer_state_format = {value!r} is not an optimizer-state format; use one of "
            f"{', '.join(repr(n) for n in OPTIMIZER_STATE_FORMATS)} (default 'fp32', exact)"
        )
    return str(value)


def _mmap_threshold(value: Any) -> int | None:
    """tiered.host_mmap_threshold: a byte size within glibc's range, or false / null (leave
    malloc alone): [Note: host allocations and glibc's heap]."""
    if value is None or value is False:
        return None
    n = parse_bytes(value, what="tiered.host_mmap_threshold")
    if not 4096 <= n <= 32 << 20:  # glibc refuses more on 64-bit hosts (HEAP_MAX_SIZE / 2)
        raise ConfigError(
            f"tiered.host_mmap_threshold = {value!r}: glibc takes 4 KiB .. 32 MiB (default 1 MiB), "
            "or false to leave malloc alone"
        )
    return n


def _errno_names(names: Any) -> tuple[str, ...]:
    """tiered.io_retry_errnos as errno names (numbers become their names); `TieredSection`
    turns them into codes once, refusing an unknown name by the key."""
    if names is None:
        return TieredSection.io_retry_errnos
    if not isinstance(names, list | tuple):
        raise ConfigError(
            f"tiered.io_retry_errnos: expected a list of errno names such as ['EAGAIN'], got {names!r}"
        )
    out = []
    for n in names:
        if isinstance(n, int) and not isinstance(n, bool):
            if n not in errno.errorcode:
                raise ConfigError(
                    f"tiered.io_retry_errnos: {n!r} is not an errno number; use names such as 'EIO'"
                )
            out.append(errno.errorcode[n])
        else:
            out.append(str(n).upper() if isinstance(n, str) else n)
    return tuple(out)
