"""The fine-tuning demo: the README's main job on its embedded default.

Fine-tunes the embedded tiny Llama (examples/tiny-llama/config.json, ~1.7M parameters, built from
its config) on the embedded corpus (examples/corpus.txt, byte tokenizer) with parameters and
optimizer state offloaded to NVMe files in a temporary folder, through the unchanged DeepSpeed
config examples/ds_config.json; shows the loss going down; runs the same steps with plain PyTorch
AdamW and prints both final losses and the largest parameter difference; prints the tier stats
and where the trained model went (`--out`, temporary by default) with the line that loads it;
then the `tiered plan` verdict for fine-tuning a 40B model on one 80 GB GPU (`plan.answer`, the
search's fastest config that fits and its predicted s/step).

[Note: where the examples live]
examples/ sits at the repository root, next to the `tiered` package, and is found relative to
the package (`tiered/../examples`): an editable install (`pip install -e .`) keeps that layout.
A wheel install does not ship it; the demo then says so and where it looked, instead of failing
somewhere inside transformers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from tiered.errors import TieredError

# Steps of each run (engine and plain PyTorch): quick fits ~15 s, full ~30-60 s on 2 CPU cores.
QUICK_STEPS = 8
FULL_STEPS = 20
SEQ_LEN = 128
# Equal to rounding on fp32 (the equivalence tests hold 1e-5 over 3 steps; more steps grow it).
MATCH_REL = 1e-4
PLAN_40B_ARGS = ["--params", "40B", "--gpu-mem", "80GB", "--cpu-mem", "512GB", "--nvme-mem", "4TB"]
"""The demo's `tiered plan`: fine-tuning a 40B model on one 80 GB GPU, 512 GB of RAM, a 4 TB NVMe."""


def examples_dir() -> Path:
    """The repository's examples/ folder ([Note: where the examples live])."""
    import tiered

    root = Path(tiered.__file__).resolve().parent.parent / "examples"
    needed = [root / "tiny-llama" / "config.json", root / "ds_config.json", root / "corpus.txt"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise TieredError(
            f"the demo's example files are missing: {', '.join(missing)}; the demo runs from a source "
            "checkout installed with `pip install -e .` (examples/ at the repository root)"
        )
    return root


def plan_verdict(out: TextIO) -> int:
    """The 40B single-GPU plan in a few lines, computed as `tiered plan` computes it (`plan.answer`):
    each placement's peaks and s/step, then the fastest config that fits; 0 when one fits."""
    from tiered.cli import plan

    parser = argparse.ArgumentParser(prog="tiered")
    plan.add_parser(parser.add_subparsers(dest="command"))
    a = plan.answer(parser.parse_args(["plan", *PLAN_40B_ARGS]))
    w = out.write
    dp = a.table[0]
    w(
        f"model states of {a.psi / 1e9:.0f}B parameters in bf16 with Adam: {dp.gpu_bytes / 1e9:.0f} GB "
        f"(the ZeRO paper's {dp.gpu_bytes // a.psi} B per parameter); one GPU has {(a.memories.gpu or 0) / 1e9:.0f} GB\n"
    )
    plan.render_placements(a.result, [], out)
    fits = [c for c in a.result.per_placement() if c.fits]
    if fits and not any(c.knobs["offload_optimizer"] == "none" for c in fits):
        w("no placement without offload fits; the fastest config that does:\n")
    plan.render_search(a.result, out)
    w(f"(the whole plan, with its assumptions: tiered plan {' '.join(PLAN_40B_ARGS)})\n")
    return 0 if a.result.best is not None else 1


def run_demo(
    quick: bool,
    workdir: Path | None,
    out: TextIO | None = None,
    run_dir: Path | None = None,
    overwrite: bool = False,
) -> int:
    """Run the demo (see the module doc); 0 when the loss went down and tiered matched plain
    PyTorch, 1 otherwise. `workdir` holds the temporary NVMe folder (default: system temp);
    `run_dir` is the fine-tuning's --out (default: a folder inside that temporary one, removed
    with it, and then no line to load the model is printed); `overwrite`: --overwrite."""
    from tiered.cli.finetune import finetune_job
    from tiered.cli.finetune.options import CheckpointOptions, FinetuneOptions

    out = out or sys.stdout
    w = out.write
    ex = examples_dir()
    steps = QUICK_STEPS if quick else FULL_STEPS
    if workdir is not None and not Path(workdir).is_dir():
        raise TieredError(f"demo work folder {workdir} does not exist; create it or omit it")
    w(
        f"== 1. fine-tune a tiny Llama on {ex / 'corpus.txt'} for {steps} steps, parameters and Adam "
        "state offloaded to NVMe files\n"
    )
    w(f"   (DeepSpeed config {ex / 'ds_config.json'}, unchanged but for nvme_path)\n\n")
    out.flush()
    with tempfile.TemporaryDirectory(prefix="tiered-finetune-demo-", dir=workdir) as tmp:
        # A temporary run folder is removed with `tmp`: the job then prints no line to load it.
        checkpoints = CheckpointOptions(
            run_dir if run_dir is not None else Path(tmp) / "run",
            temporary=run_dir is None,
            overwrite=overwrite,
        )
        job = finetune_job(
            FinetuneOptions(
                model_path=ex / "tiny-llama",
                config=ex / "ds_config.json",
                data_path=ex / "corpus.txt",
                seq_len=SEQ_LEN,
                steps=steps,
                log_every=1 if quick else 2,
                nvme_path=str(Path(tmp) / "nvme"),
                compare_torch=True,
                checkpoints=checkpoints,
            ),
            out,
        )
    status = 0
    r = job.result
    if r.interrupted:
        return 130
    went_down = len(r.losses) >= 2 and r.losses[-1] < r.losses[0]
    matched = job.max_rel_diff is not None and job.max_rel_diff <= MATCH_REL
    w(
        f"\nloss {'went down' if went_down else 'DID NOT go down'}: {r.losses[0]:.4f} -> {r.losses[-1]:.4f}; "
        f"tiered {'matches' if matched else 'DOES NOT match'} plain PyTorch AdamW "
        f"(max rel parameter diff {job.max_rel_diff:.2e}, limit {MATCH_REL:g})\n"
    )
    if not (went_down and matched):
        status = 1
    w("\n== 2. will a 40B model fit one 80 GB GPU? (tiered plan, 512 GB RAM, 4 TB NVMe)\n\n")
    plan_status = plan_verdict(out)
    return max(status, plan_status)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo-finetune",
        help="fine-tune a tiny Llama with NVMe offload, compare with PyTorch, then plan a 40B model",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps instead of {FULL_STEPS}")
    p.add_argument("--dir", default=None, help="where the temporary NVMe folder goes (default: system temp)")
    p.add_argument(
        "--out", default=None, metavar="DIR", help="keep the trained model in DIR/final (default: temporary)"
    )
    p.add_argument("--overwrite", action="store_true", help="--out holds an earlier run: replace it")
    return p


def run(args: argparse.Namespace) -> int:
    return run_demo(
        bool(args.quick),
        Path(args.dir) if args.dir else None,
        run_dir=Path(args.out) if args.out else None,
        overwrite=bool(args.overwrite),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiered.cli.demo_finetune")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["demo-finetune", *(argv if argv is not None else sys.argv[1:])])
    try:
        return run(args)
    except TieredError as exc:
        print(f"tiered demo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
