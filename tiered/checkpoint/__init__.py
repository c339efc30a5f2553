"""Checkpoints: the full training state as safetensors files plus a JSON manifest, written
atomically and streamed partition by partition (see [Note: atomic checkpoint] and
[Note: streamed safetensors]). The engine calls `save_engine_state` / `load_engine_state`."""

from __future__ import annotations

from tiered.checkpoint.consolidate import iter_parameters, read_parameters
from tiered.checkpoint.directory import FORMAT_VERSION, find_latest_valid, read_latest, read_manifest
from tiered.checkpoint.stream import CHECKSUM_ALGORITHM, StreamWriter, TensorSpec, verify_file
from tiered.checkpoint.writer import CheckpointWriter, load_tensors, save_tensors

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CheckpointWriter",
    "FORMAT_VERSION",
    "StreamWriter",
    "TensorSpec",
    "find_latest_valid",
    "iter_parameters",
    "load_tensors",
    "read_latest",
    "read_manifest",
    "read_parameters",
    "save_tensors",
    "verify_file",
]
