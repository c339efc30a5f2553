"""The cost of a compressed optimizer-state format ([Note: compressed optimizer state]):
the same 300-step run of the examples/tiny-llama shape (a Llama, byte vocabulary) on a corpus
(--corpus) with exact fp32 Adam and each compressed format, parameters + gradients + Adam
state on NVMe (a temporary directory), same data and seed. Prints the loss curves at intervals,
the final eval loss and its difference from exact, NVMe bytes per step (measured by the tier
manager, and the formula) and s/step; saves a plot when matplotlib is installed.

    python benchmarks/state_format.py [--steps 300] [--formats fp32,bf16,int8] [--plot out.png]
        [--pretrain-steps N] [--lr LR] [--corpus examples|pydoc]

With --pretrain-steps N the model is first trained N steps by plain torch AdamW (fp32, lr 1e-3)
on the first two thirds of the training text, and each format fine-tunes those weights (fresh
optimizer state) on the last third: a fine-tune of a model that has learnt the text's statistics,
not a run from random weights. The held-out tenth is evaluated in both modes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import torch

import tiered

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEQ, BATCH = 64, 8


CORPORA = ("examples", "pydoc")
"""examples/corpus.txt (6 KB), or the English of Python's own reference documentation
(``pydoc_data.topics``, ~466 KB, shipped with every CPython): real text on any machine."""


def _data(corpus: str = "examples") -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out tenth) of `corpus` (one of CORPORA)."""
    if corpus == "pydoc":
        import pydoc_data.topics

        data = "\n".join(pydoc_data.topics.topics.values()).encode()
    else:
        data = (ROOT / "examples" / "corpus.txt").read_bytes()
    raw = torch.tensor(list(data), dtype=torch.long)
    cut = int(0.9 * raw.numel())
    return raw[:cut], raw[cut:]


def _split(train: torch.Tensor, pretrain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre-training text, fine-tuning text): two thirds and one third with --pretrain-steps."""
    if not pretrain:
        return train[:0], train
    cut = 2 * train.numel() // 3
    return train[:cut], train[cut:]


def pretrained_state(steps: int, corpus: str = "examples") -> dict[str, torch.Tensor]:
    """The weights after `steps` of plain torch AdamW from _model()'s initialisation."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    text, _ = _split(_data(corpus)[0], True)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        b = _batch(text, g)
        model(input_ids=b[:, :-1], labels=b[:, 1:].contiguous()).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _batch(text: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, text.numel() - SEQ - 1, (BATCH,), generator=g)
    return torch.stack([text[s : s + SEQ + 1] for s in starts.tolist()])


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((ROOT / "examples" / "tiny-llama" / "config.json").read_text())
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _loss(engine, batch: torch.Tensor) -> torch.Tensor:
    return engine(input_ids=batch[:, :-1], labels=batch[:, 1:].contiguous()).loss


def run(
    fmt: str,
    steps: int,
    every: int,
    start: dict[str, torch.Tensor] | None = None,
    lr: float = 1e-3,
    corpus: str = "examples",
) -> dict:
    """`start`: the weights to fine-tune (pretrained_state), or None for _model()'s."""
    train, held = _data(corpus)
    train = _split(train, start is not None)[1]
    with tempfile.TemporaryDirectory() as nvme:
        off = {"device": "nvme", "nvme_path": nvme}
        config = {
            "train_batch_size": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_optimizer": off, "offload_param": off},
            "tiered": {"optimizer_state_format": fmt, "grad_tier": "nvme"},
        }
        model = _model()
        if start is not None:
            model.load_state_dict(start)
        engine = tiered.initialize(model, config)
        g = torch.Generator().manual_seed(1)
        curve, t0 = [], time.perf_counter()
        try:
            for step in range(1, steps + 1):
                loss = _loss(engine, _batch(train, g))
                engine.backward(loss)
                engine.step()
                if step % every == 0 or step == 1:
                    curve.append((step, float(loss.detach())))
            secs = (time.perf_counter() - t0) / steps
            bps = engine.stats()["bytes_per_step"]
            eg = torch.Generator().manual_seed(2)
            with torch.no_grad():
                ev = sum(float(_loss(engine, _batch(held, eg))) for _ in range(16)) / 16
        finally:
            engine.close()
    disk = ("disk->host", "host->disk")
    return {
        "format": fmt,
        "curve": curve,
        "eval_loss": ev,
        "s_per_step": secs,
        "nvme_bytes_measured": sum(bps["measured"][k] for k in disk),
        "nvme_bytes_formula": sum(bps["formula"][k] for k in disk),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--formats", default="fp32,bf16,int8")
    ap.add_argument("--plot", default=None, help="save the loss curves here (needs matplotlib)")
    ap.add_argument("--pretrain-steps", type=int, default=0, help="fine-tune weights pre-trained this long")
    ap.add_argument("--lr", type=float, default=1e-3, help="the compared runs' AdamW learning rate")
    ap.add_argument("--corpus", choices=CORPORA, default="examples", help="the text (default examples)")
    args = ap.parse_args()
    start = None
    if args.pretrain_steps:
        t0 = time.perf_counter()
        start = pretrained_state(args.pretrain_steps, args.corpus)
        print(f"pre-trained {args.pretrain_steps} steps (plain AdamW) in {time.perf_counter() - t0:.0f} s")
    results = [run(f, args.steps, args.every, start, args.lr, args.corpus) for f in args.formats.split(",")]
    base = results[0]
    print("step  " + "  ".join(f"{r['format']:>8}" for r in results))
    for i, (step, _) in enumerate(base["curve"]):
        print(f"{step:4d}  " + "  ".join(f"{r['curve'][i][1]:8.4f}" for r in results))
    for r in results:
        print(
            f"{r['format']}: eval loss {r['eval_loss']:.4f} (vs {base['format']} "
            f"{r['eval_loss'] - base['eval_loss']:+.4f}), NVMe bytes/step measured "
            f"{r['nvme_bytes_measured'] / 1e6:.2f} MB ({r['nvme_bytes_measured'] / base['nvme_bytes_measured']:.3f}x), "
            f"formula {r['nvme_bytes_formula'] / 1e6:.2f} MB, {r['s_per_step'] * 1e3:.1f} ms/step "
            f"({r['s_per_step'] / base['s_per_step']:.2f}x)"
        )
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        for r in results:
            plt.plot(*zip(*r["curve"], strict=True), label=r["format"])
        plt.xlabel("step")
        plt.ylabel("train loss")
        plt.legend()
        plt.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
