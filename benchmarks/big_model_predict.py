"""`tiered plan`'s predicted s/step for the 2B replica (benchmarks/big_model.py), without running
it (issue 21: predicted within 25% of measured). Takes big_model.py's own options and defaults
(2.07B Llama, hidden 2560, 25 layers, vocab 16384, 1 x 128 tokens, fp32; parameters, gradients
and Adam state homed on NVMe, the step overlapped with backward), writes the model's config.json
to a temporary folder, and runs `tiered plan --model` on it with every knob the replica sets
pinned (so the plan weighs exactly the replica's config) and --device cpu: the compute term is
the model's own layer timed here ([Note: model compute probe]).

    python benchmarks/big_model_predict.py [big_model.py options] [--bandwidth bench.json] [--json]

Compare its "predicted ... s/step" with big_model.py's measured median step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import big_model  # noqa: E402
import big_model_engine as eng  # noqa: E402

from tiered.cli.main import main as tiered_main  # noqa: E402


def plan_argv(spec: dict[str, object], folder: Path, extra: list[str]) -> list[str]:
    """`tiered plan` options for the replica's config (engine_config's keys, pinned)."""
    cfg = eng.engine_config(spec)
    zero = cfg["zero_optimization"]
    tiers = cfg["tiered"]["tiers"]
    return [
        "plan",
        "--model",
        str(folder),
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--seq-len",
        str(spec["seq"]),
        "--micro-batch",
        str(spec["batch"]),
        "--gpu-mem",
        tiers["gpu"]["budget"],
        "--cpu-mem",
        tiers["cpu"]["budget"],
        "--nvme-mem",
        tiers["nvme"]["budget"],
        # The activations live in the process's memory beside the tier budgets (the replica's RSS
        # target adds a headroom for them): the budgets are what the plan's memories stand for.
        "--activation-mem",
        "0",
        "--nvme-path",
        str(folder / "swap"),
        "--offload-optimizer",
        "nvme",
        "--offload-param",
        "nvme",
        "--grad-tier",
        cfg["tiered"]["grad_tier"],
        "--max-in-cpu",
        str(zero["offload_param"]["max_in_cpu"]),
        "--persistence-threshold",
        str(zero["stage3_param_persistence_threshold"]),
        "--buffer-count",
        str(zero["offload_optimizer"]["buffer_count"]),
        "--sub-group-size",
        str(int(zero["sub_group_size"])),
        "--max-live-parameters",
        str(zero["stage3_max_live_parameters"]),
        "--overlap-step",
        "on" if cfg["tiered"]["overlap_step_with_backward"] else "off",
        *extra,
    ]


def main(argv: list[str] | None = None) -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument(
        "--bandwidth", help="tiered bench --json output (default: the plan's assumed bandwidths)"
    )
    ours.add_argument("--json", action="store_true", help="the plan's JSON instead of its text")
    mine, rest = ours.parse_known_args(argv)
    args = big_model.argument_parser().parse_args(rest)
    with tempfile.TemporaryDirectory(prefix="big-model-predict-") as d:
        folder = Path(d)
        spec = big_model.make_spec(args, folder)
        (folder / "config.json").write_text(json.dumps(spec["hf_config"], default=str))
        extra = (["--bandwidth", mine.bandwidth] if mine.bandwidth else []) + (
            ["--json"] if mine.json else []
        )
        argv_plan = plan_argv(spec, folder, extra)
        print("tiered " + " ".join(argv_plan), file=sys.stderr)
        return tiered_main(argv_plan)


if __name__ == "__main__":
    raise SystemExit(main())
