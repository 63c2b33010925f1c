"""How close is each rank's share of the ring's compute to the limit, one kernel's time / cp?

    python benchmarks/cp_rank_compute.py [--device cuda] [--cp 2 4 8] [--seq 4096] [--heads 8]
                                         [--dim 64] [--dtype bf16] [--iters 10]

One process, one device, no communication: for every rank, the blocks, merges and sums
that rank runs in the ring's forward and backward (gradsched.cp.ring_simulation.rank_compute,
the code the ring and the simulation run), with every K/V at hand. The limit is the
same kernel forward + backward over the whole sequence, divided by cp: what a rank would
take if the work split perfectly and communication were free. fraction_of_limit =
limit / the slowest rank's time (the slowest rank sets the ring's pace).

This isolates the schedule's compute efficiency: fully masked blocks skipped, diagonal
blocks on the kernel's causal path, calls joined or not. It says nothing of how well the
ring hides its communication (benchmarks/cp_speed.py measures the real ring over gloo).
Both schedules are timed on CPU: "fast" (fewest_roundings=False, no mask tensors; the default
on CUDA) and "fewest_roundings" (a row chunk's calls of a window joined, its diagonal as a mask;
the default on the CPU kernel, refused on CUDA). --compile
times each rank's compute compiled by Inductor, as the ring runs under torch.compile.

On CPU it runs one thread (as each rank of the gloo benchmarks does); times move between
runs on a shared machine, so compare fractions within one run. On CUDA the times are
taken with CUDA events and are absolute, with the device named.

Output: one JSON object per (cp, causal, schedule) on stdout, also written to
benchmarks/results/cp_rank_compute.jsonl (--out for another file).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from gradsched.cp.attention_kernels import attend, attend_backward, choose_kernel
from gradsched.cp.ring_simulation import rank_compute

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "cp_rank_compute.jsonl")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def log(msg: str) -> None:
    print(f"[cp_rank_compute {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_ms(fn, iters: int, device: torch.device) -> float:
    fn()  # warm-up: kernels chosen, memory pooled
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", choices=("causal", "full", "both"), default="both")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--accumulate", nargs="+", default=["fp32"],
                   help="the ring's modes to time (on CUDA fp32/fp32_blocks run the Triton "
                        "block kernel, input runs aten flash blocks)")
    p.add_argument("--compile", action="store_true",
                   help="time each rank's compute compiled by Inductor (fullgraph), as the "
                        "ring runs under torch.compile, instead of eager")
    p.add_argument("--out", default=RESULTS, help="JSONL file for the results ('' for none)")
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    if device.type == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, 1 thread"
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(a.batch, a.heads, a.seq, a.dim, generator=g, device=device,
                                 dtype=dtype) for _ in range(4))
    scale = a.dim ** -0.5
    rows = []
    for causal in {"causal": (True,), "full": (False,), "both": (True, False)}[a.causal]:
        def whole():
            out, lse = attend(q, k, v, causal, scale)
            attend_backward(dout, q, k, v, out, lse, causal, scale)
        full_ms = median_ms(whole, a.iters, device)
        log(f"{'causal' if causal else 'full'}: one kernel over the whole sequence "
            f"({choose_kernel(device.type, dtype, False)}) {full_ms:.2f} ms")
        for cp, accumulate in [(cp, acc) for cp in a.cp for acc in a.accumulate]:
            # fewest_roundings is refused off the CPU (its mask tensors)
            for fewest in (False, True) if device.type == "cpu" else (False,):
                def rank(r):
                    fn = rank_compute(q, k, v, dout, cp, r, causal, accumulate,
                                      fewest_roundings=fewest)
                    if not a.compile:
                        return fn
                    torch._dynamo.reset()  # one compile per rank: the same code, other constants
                    return torch.compile(fn, fullgraph=True)
                per_rank = [median_ms(rank(r), a.iters, device) for r in range(cp)]
                limit = full_ms / cp
                row = {"bench": "cp_rank_compute", "device": name, "cp": cp, "causal": causal,
                       "schedule": "fewest_roundings" if fewest else "fast",
                       "accumulate": accumulate,
                       "block_kernel": choose_kernel(device.type, dtype, False, accumulate),
                       "compiled": a.compile,
                       "dtype": a.dtype, "batch": a.batch, "heads": a.heads, "seq": a.seq,
                       "dim": a.dim, "full_kernel_ms": round(full_ms, 3),
                       "limit_ms": round(limit, 3),
                       "rank_ms": [round(t, 3) for t in per_rank],
                       "fraction_of_limit": round(limit / max(per_rank), 3),
                       "mean_fraction_of_limit": round(limit / statistics.mean(per_rank), 3),
                       "torch": torch.__version__}
                log(f"  cp={cp} {accumulate} {row['schedule']}: slowest rank {max(per_rank):.2f} ms, "
                    f"{row['fraction_of_limit']:.0%} of the limit")
                rows.append(row)
    emit(rows, a.out)
    return rows


if __name__ == "__main__":
    main()
