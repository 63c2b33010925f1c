"""Under pipeline parallelism, what waits for the flush: every bucket (placement="flush") or only the
tied ones ("split", the default), measured side by side in one run.

    python benchmarks/pp_overlap.py --pp 2 --dp 2 --microbatches 4 --steps 6

Trains a small tied GPT on pp x dp gloo processes under each placement and prints one JSON
object per placement: the step time and the flush time (the sync run after the schedule has
drained, the step's exposed tail), each the median over steps after the first (which compiles)
of the slowest rank, as ratios to placement="flush"; the first step's reduced gradients against
the unsplit model in one process. CPU times are ratios only; figures in
benchmarks/results/pp_overlap.jsonl.
"""
from __future__ import annotations

import argparse
import sys

from common import RESULTS, emit, median_of_slowest  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from gradsched.tied_training import Job, gradient_error, rank_main, reference
from gradsched.tiny_gpt import GPTConfig

PLACEMENTS = ("flush", "split")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--compiler", choices=("eager", "inductor"), default="inductor")
    ap.add_argument("--out", default=str(RESULTS / "pp_overlap.jsonl"))
    args = ap.parse_args(argv)
    if args.pp < 2:
        ap.error("--pp must be >= 2: the flush exists only under pipeline parallelism")
    config = GPTConfig(vocab=1024, seq=64, dim=args.dim, heads=4, layers=args.layers)
    rows, runs = [], {}
    for placement in PLACEMENTS:
        print(f"[pp_overlap] placement={placement}: pp={args.pp} x dp={args.dp}, {args.microbatches} micro-batches, "
              f"{args.steps} steps ...", file=sys.stderr, flush=True)
        job = Job(pp=args.pp, dp=args.dp, steps=args.steps, config=config, optimizer="sgd", lr=0.1,
                  global_batch=2 * args.dp * args.microbatches, split_points=(f"blocks.{args.layers // 2}",),
                  options={"compiler": args.compiler, "placement": placement, "microbatches": args.microbatches})
        ranks = run_ranks(rank_main, job.world, job, timeout_s=900)
        runs[placement] = (median_of_slowest(ranks, "step_times"), median_of_slowest(ranks, "flush_seconds"))
        rows.append({"bench": "pp_overlap", "placement": placement, "pp": args.pp, "dp": args.dp,
                     "microbatches": args.microbatches, "compiler": args.compiler, "dim": args.dim,
                     "layers": args.layers, "gradient_error_vs_one_process": gradient_error(reference(job), ranks),
                     "flush_buckets": sorted({len(r["sync_graph_buckets"].get("flush", [])) for r in ranks}),
                     "backward_buckets": sorted({len(r["sync_graph_buckets"].get("backward", [])) for r in ranks}),
                     "device": "cpu, gloo, one thread per rank"})
    base_step, base_flush = runs["flush"]
    for row in rows:
        step, flush = runs[row["placement"]]
        row["step_time_ratio_vs_flush"] = step / base_step
        row["flush_time_ratio_vs_flush"] = flush / base_flush
    emit(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
