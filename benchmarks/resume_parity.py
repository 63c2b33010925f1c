"""Resume parity: a run stopped, checkpointed and resumed at another layout continues as if never stopped.

    python benchmarks/resume_parity.py            # tiny tied HF Llama, fp32, AdamW, clipping, param groups

Trains 6 steps at pp2 x dp2 without stopping. Then 3 steps at pp2 x dp2, a save, every
process stopped, and 3 more steps resumed at (a) pp2 x dp2, (b) pp1 x dp4, (c) pp2 x dp2 with
another bucket_mb. Every run ends in a checkpoint; each is read back whole in this process
(DCP's own reader) and compared with the uninterrupted run's: parameters, fp32 master
weights and the optimizer's moments. Prints one JSON object per variant ("bench":
"resume_parity", "variant", "max_abs_diff_vs_uninterrupted", "target") and writes them to
benchmarks/results/resume_parity.jsonl.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

from common import RESULTS, emit  # benchmarks/common.py: also puts examples/ on the path
from gradsched.launch import run_ranks
from tied_training import Job, checkpoint_contents, max_state_diff, resume_main
from tiny_gpt import GPTConfig


def job(model: str, pp: int, dp: int, **options) -> Job:
    return Job(model=model, pp=pp, dp=dp, optimizer="adamw", lr=1e-3, clip=1.0, param_groups="decay_matrices",
               config=GPTConfig(vocab=97), global_batch=8,
               options={"compiler": "eager", "microbatches": 2, **options})


VARIANTS = {  # name -> (layout of the resumed half, target)
    "a_same_layout": (dict(pp=2, dp=2), 1e-6),
    "b_pp1_dp4": (dict(pp=1, dp=4), 1e-5),
    "c_other_bucket_mb": (dict(pp=2, dp=2, bucket_mb=0.004), 1e-6),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hf_llama", choices=("hf_llama", "hf_gpt2", "tiny_gpt"))
    ap.add_argument("--steps", type=int, default=6, help="total steps; the stop comes after half")
    ap.add_argument("--out", default=str(RESULTS / "resume_parity.jsonl"))
    args = ap.parse_args(argv)
    half = args.steps // 2
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[resume_parity] {args.model}: {args.steps} steps at pp2 x dp2 without stopping ...", file=sys.stderr)
        run_ranks(resume_main, 4, job(args.model, 2, 2), f"{tmp}/whole", None, args.steps, timeout_s=900)
        whole = checkpoint_contents(f"{tmp}/whole")
        print(f"[resume_parity] {half} steps, save, stop ...", file=sys.stderr)
        run_ranks(resume_main, 4, job(args.model, 2, 2), f"{tmp}/half", None, half, timeout_s=900)
        rows = []
        for name, (layout, target) in VARIANTS.items():
            print(f"[resume_parity] resume {name} ...", file=sys.stderr, flush=True)
            layout = dict(layout)
            j = job(args.model, layout.pop("pp"), layout.pop("dp"), **layout)
            starts = run_ranks(resume_main, 4, j, f"{tmp}/{name}", f"{tmp}/half", args.steps, timeout_s=900)
            diff = max_state_diff(whole, checkpoint_contents(f"{tmp}/{name}"))
            rows.append({"bench": "resume_parity", "model": args.model, "variant": name, "steps": args.steps,
                         "stopped_after": half, "resumed_from": starts[0]["start"],
                         "max_abs_diff_vs_uninterrupted": diff, "target": target, "ok": diff <= target})
    emit(rows, args.out)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
