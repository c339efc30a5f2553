"""The knobs a user fixed for the search ([Note: config search] in search.py), and how each is
named in errors: `tiered plan`'s flag or the config's own key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered.config.fields import declared_key
from tiered.errors import ConfigError
from tiered.planning.candidate import KNOB_FIELDS


def flag_name(knob: str) -> str:
    """`tiered plan`'s flag for `knob` (``--offload-optimizer``)."""
    return "--" + knob.replace("_", "-")


def config_name(knob: str) -> str:
    """The config key of `knob` (``zero_optimization.offload_optimizer.device``)."""
    return declared_key(KNOB_FIELDS[knob]).path


@dataclass(frozen=True)
class Pinned:
    """Knobs the user fixed (absent: searched), and how the user spelled them: `flag_name`
    (`tiered plan`) or `config_name` (a config's own keys, ``auto_config``)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    spelled: Mapping[str, str] = field(default_factory=dict)
    """knob -> its name in errors; `flag_name` where absent."""

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def name(self, knob: str) -> str:
        return self.spelled.get(knob) or flag_name(knob)

    def merged(self, other: Pinned) -> Pinned:
        """Both pins; a knob both fix differently is refused, naming both spellings."""
        for k, v in other.values.items():
            if k in self.values and self.values[k] != v:
                raise ConfigError(
                    f"contradictory pinned knobs: {self.name(k)} {self.values[k]} but {other.name(k)} {v}"
                )
        return Pinned({**self.values, **other.values}, {**self.spelled, **other.spelled})

    def check(self) -> None:
        """Refuse contradictory pins by name ([Note: config search])."""
        v, n = self.values, self.name
        opt, par, grad = v.get("offload_optimizer"), v.get("offload_param"), v.get("grad_tier")
        problems = []
        if opt == "none" and grad not in (None, "gpu"):
            problems.append(
                f"{n('grad_tier')} {grad} needs the optimizer offloaded, but {n('offload_optimizer')} is none"
            )
        if opt == "none" and par not in (None, "none"):
            problems.append(
                f"{n('offload_param')} {par} needs the optimizer offloaded, but {n('offload_optimizer')} is none"
            )
        if opt not in (None, "none") and grad == "gpu":
            problems.append(
                f"{n('grad_tier')} gpu needs the optimizer on the GPU, but {n('offload_optimizer')} is {opt}"
            )
        if v.get("max_in_cpu") not in (None, 0) and par not in (None, "nvme"):
            problems.append(
                f"{n('max_in_cpu')} keeps NVMe parameters in cpu, but {n('offload_param')} is {par}"
            )
        if problems:
            raise ConfigError("contradictory pinned knobs: " + "; ".join(problems))


NOTHING_PINNED = Pinned()
"""Every knob searched (the default of `search`'s `pinned`)."""
