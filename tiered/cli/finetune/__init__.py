"""`tiered finetune`: fine-tune a local Hugging Face causal LM with ZeRO-3 offload.

One module per part of the command: `parser` (its flags) and `options` (the frozen values they
build), `config` (the command line over the config file, and its refusals), `machine` (the config
planned from this machine without ``--config``), `trace` (the trace and plot flags), and `command`
(the job that wires them to `tiered.finetune` and prints the progress and stats). The command
table (tiered/cli/main.py) finds `add_parser` and `run` here; `finetune_job` and the option
objects are what the demo and scripts call.
"""

from __future__ import annotations

from tiered.cli.finetune.command import JobResult, finetune_job, run
from tiered.cli.finetune.options import CheckpointOptions, FinetuneOptions
from tiered.cli.finetune.parser import add_parser

__all__ = ["CheckpointOptions", "FinetuneOptions", "JobResult", "add_parser", "finetune_job", "run"]
