"""Training parity: a Hugging Face causal LM trained in parallel vs the same model in one process.

    python benchmarks/train_parity.py --model hf_gpt2 --dtype float32 --steps 5            # pp2 x dp2 x cp2
    python benchmarks/train_parity.py --model hf_gpt2 --dtype bfloat16 --steps 50 --pp 2 --dp 1 --cp 4 \
        --seq 256 --accumulate fp32 input

Prints one JSON object per step ("bench": "train_parity", "model", "step", "loss",
"loss_reference", "rel_diff", plus "accumulate" and "dtype"), then one summary object
per accumulate mode with "max_rel_diff". The reference is always the unsplit model in
fp32. Results go to benchmarks/results/train_parity_<dtype>.jsonl, with a plot of the
loss curves (train_parity_<dtype>.png) when matplotlib is installed (`.[bench]`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from common import RESULTS  # benchmarks/common.py: also puts examples/ on the path
from gradsched.launch import run_ranks
from tied_training import Job, rank_main, reference
from tiny_gpt import GPTConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hf_gpt2", choices=("hf_gpt2", "hf_llama", "tiny_gpt"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16, help="sequence length (a multiple of 2 x cp)")
    ap.add_argument("--accumulate", nargs="+", default=["fp32"], choices=("fp32", "input", "fp32_blocks"))
    ap.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    args = ap.parse_args(argv)

    rows, curves = [], {}
    ref = None
    for acc in args.accumulate:
        job = Job(model=args.model, pp=args.pp, dp=args.dp, cp=args.cp, steps=args.steps, dtype=args.dtype,
                  config=GPTConfig(seq=args.seq),
                  global_batch=4 * args.dp * args.microbatches, data_batches=4,
                  options={"compiler": args.compiler, "microbatches": args.microbatches, "accumulate": acc,
                           **({"reduce_dtype": torch.float32} if args.dtype != "float32" else {})})
        print(f"[train_parity] {args.model} {args.dtype} accumulate={acc}: pp={args.pp} dp={args.dp} "
              f"cp={args.cp}, {job.world} processes, {args.steps} steps ...", file=sys.stderr, flush=True)
        ranks = run_ranks(rank_main, job.world, job, timeout_s=900)
        if ref is None:
            print("[train_parity] fp32 reference in one process ...", file=sys.stderr, flush=True)
            ref = reference(Job(**{**job.__dict__, "dtype": "float32"}))
        last = [r for r in ranks if r["losses"][0] is not None]
        losses = [sum(r["losses"][s] for r in last) / len(last) for s in range(args.steps)]
        curves[acc] = losses
        diffs = []
        for step, (got, want) in enumerate(zip(losses, ref["losses"])):
            diffs.append(abs(got - want) / abs(want) if math.isfinite(got) and math.isfinite(want) else math.inf)
            rows.append({"bench": "train_parity", "model": args.model, "dtype": args.dtype, "accumulate": acc,
                         "step": step + 1, "loss": got, "loss_reference": want, "rel_diff": diffs[-1]})
            print(json.dumps(rows[-1]), flush=True)
        summary = {"bench": "train_parity", "model": args.model, "dtype": args.dtype, "accumulate": acc,
                   "summary": True, "steps": args.steps, "pp": args.pp, "dp": args.dp, "cp": args.cp,
                   "seq": args.seq,
                   "max_rel_diff": max(diffs), "device": "cpu, gloo"}
        rows.append(summary)
        print(json.dumps(summary), flush=True)

    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"train_parity_{args.model}_{args.dtype}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _plot(curves, ref["losses"], args, RESULTS / f"train_parity_{args.model}_{args.dtype}.png")
    print(f"[train_parity] wrote {out}", file=sys.stderr)
    return 0


def _plot(curves, reference_losses, args, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[train_parity] matplotlib not installed (pip install .[bench]): no plot", file=sys.stderr)
        return
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    steps = range(1, len(reference_losses) + 1)
    ax.plot(steps, reference_losses, "k-", lw=2.5, label="one process, fp32 (reference)")
    for acc, losses in curves.items():
        label = f"pp{args.pp} x dp{args.dp} x cp{args.cp}, {args.dtype}, accumulate={acc}"
        ax.plot(steps, losses, "--", label=label)
        dx.semilogy(steps, [abs(a - b) / abs(b) or float("nan") for a, b in zip(losses, reference_losses)],
                    ".-", label=f"accumulate={acc}")
    ax.set_ylabel("loss")
    ax.set_title(f"{args.model}: parallel vs single-process training")
    ax.legend()
    dx.set_xlabel("step")
    dx.set_ylabel("|loss - reference| / reference")
    dx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[train_parity] plot {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
