"""How much of the data-parallel reduction is issued while the backward still computes, read from
the code Inductor generated, and what it does to the step, against every bucket at the flush.

    python benchmarks/overlap.py --pp 2 --dp 2
    python benchmarks/overlap.py --pp 1 --dp 4

Trains a GPT of about 46M parameters (dim 768, 6 layers, tied embedding) on pp x dp gloo processes,
once with the default placement (pp > 1: "tied_at_flush", only tied buckets wait for the flush; pp = 1:
"backward") and once with placement="flush" (every bucket after the backward: what gradsched did
before), and prints one JSON object per placement:

  overlap_fraction   bytes of data-parallel reduction issued before the last compute kernel of the
                     step's last backward, over all data-parallel bytes of the step. Read per rank
                     from the output code of the backward and flush graphs (the flush runs after the
                     backward, so its bytes never count); the smallest over ranks.
  dp_bytes_per_step  data-parallel reduction bytes of the step, per rank (largest over ranks), from the
                     same code
  backward_kernels_left_at_issue: byte-weighted mean, over the step's dp reductions, of the
                     fraction of the backward's compute kernels still to run when each is issued
                     (flush bytes count 0); smallest over ranks. overlap_fraction says whether a
                     reduction is issued before the backward ends; this says how early.
  step_ms_median     median over steps after the first (which compiles) of the slowest rank: a CPU
                     time, reported only as the ratio step_time_ratio_vs_flush
  gradient_error_vs_one_process, max_abs_param_diff_vs_one_process: the first step's reduced
                     gradients and the last step's parameters against the unsplit model in one process

CPU, gloo, one thread per rank: 4 ranks share 2 cores here, so the step ratio says little about a
GPU cluster; overlap_fraction is what the code does wherever it runs.
"""
from __future__ import annotations

import argparse
import sys

from common import RESULTS, emit, median_of_slowest  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.sync.compiled_code import bytes_before_last_compute, kernels_left
from gradsched.launch import run_ranks
from tied_training import Job, compare, gradient_error, rank_main, reference
from tiny_gpt import GPTConfig


def overlap_of(rank: dict) -> tuple[int, int, float]:
    """(dp bytes issued before the backward's last compute kernel, all dp bytes, byte-weighted
    fraction of the backward's kernels still to run at issue) of one rank."""
    code = rank["sync_code"]
    if any(c is None for c in code.values()):
        raise SystemExit("overlap.py reads Inductor's output code: run with --compiler inductor")
    early, total, left = 0, 0, []
    if "backward" in code:
        early, total = bytes_before_last_compute(code["backward"], rank["grad_group"])
        left = kernels_left(code["backward"], rank["grad_group"])
    if "flush" in code:  # runs after the schedule has drained: nothing in it overlaps the backward
        flush = bytes_before_last_compute(code["flush"], rank["grad_group"])[1]
        total += flush
        left.append((flush, 0.0))
    return early, total, sum(b * f for b, f in left) / max(1, sum(b for b, _ in left))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=0, help="default: 2 x pp")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", default=None, help="JSONL file (default benchmarks/results/overlap_pp{pp}_dp{dp}.jsonl)")
    args = ap.parse_args(argv)
    m = args.microbatches or 2 * args.pp
    config = GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.dim // 64, layers=args.layers)
    rows, times = [], {}
    for placement in ("flush", "tied_at_flush" if args.pp > 1 else "backward"):
        print(f"[overlap] placement={placement}: pp={args.pp} x dp={args.dp}, {m} micro-batches, {args.steps} "
              "steps (the first compiles) ...", file=sys.stderr, flush=True)
        job = Job(pp=args.pp, dp=args.dp, steps=args.steps, config=config, optimizer="sgd", lr=0.1,
                  global_batch=args.dp * m, split_points=(f"blocks.{args.layers // 2}",),
                  options={"compiler": "inductor", "placement": placement, "microbatches": m,
                           "bucket_mb": args.bucket_mb})
        ranks = run_ranks(rank_main, job.world, job, timeout_s=1800)
        ref = reference(job)
        overlaps = [overlap_of(r) for r in ranks]
        times[placement] = median_of_slowest(ranks, "step_times")
        rows.append({"bench": "overlap", "pp": args.pp, "dp": args.dp, "placement": placement,
                     "microbatches": m, "params": sum(p.numel() for p in ref["params"].values()) - args.vocab * args.dim,
                     "bucket_mb": args.bucket_mb,
                     "dp_bytes_per_step": max(t for _, t, _ in overlaps),
                     "overlap_fraction": min(e / t for e, t, _ in overlaps),
                     "overlap_fraction_per_rank": [round(e / t, 4) for e, t, _ in overlaps],
                     "backward_kernels_left_at_issue": min(k for _, _, k in overlaps),
                     "step_ms_median": 1e3 * times[placement],
                     "gradient_error_vs_one_process": gradient_error(ref, ranks),
                     "max_abs_param_diff_vs_one_process": compare(ref, ranks)["max_abs_diff"],
                     "device": "cpu, gloo, one thread per rank"})
        print(rows[-1], file=sys.stderr, flush=True)
    for row in rows:
        row["step_time_ratio_vs_flush"] = times[row["placement"]] / times["flush"]
    emit(rows, args.out or RESULTS / f"overlap_pp{args.pp}_dp{args.dp}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
