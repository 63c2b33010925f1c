"""Tied-gradient sync: correctness, verifier verdict, tied bytes and step time of each mode.

    python benchmarks/tied_grad_sync.py --pp 2 --dp 2 --steps 3

Starts its own gloo processes for each mode, trains the tiny tied GPT, and
compares every parameter with the unsplit model trained in one process. Prints
one JSON object per mode on stdout (progress on stderr) and writes them to
benchmarks/results/tied_grad_sync.jsonl. Step times are CPU times measured in
this one run, reported only as ratios to tied_first (steps after the first,
which compiles).
"""
from __future__ import annotations

import argparse
import sys

from common import RESULTS, emit, median_of_slowest  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from tied_training import Job, compare, rank_main, reference

MODES = ("tied_first", "shard_aligned", "unsafe_rs_first")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    ap.add_argument("--out", default=str(RESULTS / "tied_grad_sync.jsonl"))
    args = ap.parse_args(argv)
    if args.pp < 2:
        ap.error("--pp must be >= 2: ties across pipeline stages are what this measures")

    rows, times = [], {}
    for mode in MODES:
        print(f"[tied_grad_sync] {mode}: pp={args.pp} dp={args.dp}, {args.pp * args.dp} processes ...",
              file=sys.stderr, flush=True)
        job = Job(pp=args.pp, dp=args.dp, steps=args.steps, global_batch=4 * args.dp * args.microbatches,
                  options={"compiler": args.compiler, "mode": mode, "microbatches": args.microbatches,
                           "allow_hazard": mode == "unsafe_rs_first"})
        ranks = run_ranks(rank_main, args.pp * args.dp, job, timeout_s=600)
        cmp = compare(reference(job), ranks)
        times[mode] = median_of_slowest(ranks)
        rows.append({
            "bench": "tied_grad_sync", "pp": args.pp, "dp": args.dp, "mode": mode,
            "microbatches": args.microbatches, "steps": args.steps, "compiler": args.compiler,
            "max_abs_diff_vs_reference": cmp["max_abs_diff"],
            "tied_bitwise_equal": cmp["tied_bitwise_equal"],
            "verifier": "hazard" if any(r["verifier"] != "ok" for r in ranks) else "ok",
            "tied_bytes_per_step": max(r["tied_bytes_per_step"] for r in ranks),
            "device": "cpu, gloo, one thread per rank",
        })
    for row in rows:
        row["step_time_ratio_vs_tied_first"] = round(times[row["mode"]] / times["tied_first"], 3)
    emit(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
