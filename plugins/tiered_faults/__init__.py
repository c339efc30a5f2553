"""tiered "faults" backend: wraps any backend spec and injects errors, delays, hangs, torn writes,
bit flips and a full disk, so a setup (or the test suite) meets real-looking storage faults."""

from __future__ import annotations

from tiered_faults.backend import FaultsBackend
from tiered_faults.rules import FAULT_KINDS, FaultRule, parse_faults

__all__ = ["FAULT_KINDS", "FaultRule", "FaultsBackend", "parse_faults"]
