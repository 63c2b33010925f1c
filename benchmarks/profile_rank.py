"""Where one rank's ring compute spends its time, by kernel (torch.profiler), against the
limit: python benchmarks/profile_rank.py --device cuda --cp 8 --seq 32768 --heads 16 --dim 128"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from gradsched.cp.attention_kernels import attend, attend_backward
from gradsched.cp.ring_simulation import rank_compute


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile", action="store_true", help="the rank's compute through Inductor")
    a = p.parse_args()
    dev = torch.device(a.device)
    q, k, v, do = (torch.randn(1, a.heads, a.seq, a.dim, device=dev, dtype=torch.bfloat16)
                   for _ in range(4))
    run = rank_compute(q, k, v, do, a.cp, a.rank, a.causal)
    if a.compile:
        run = torch.compile(run, fullgraph=True)

    def whole():
        out, lse = attend(q, k, v, a.causal, a.dim ** -0.5)
        attend_backward(do, q, k, v, out, lse, a.causal, a.dim ** -0.5)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for name, fn in (("whole sequence, one kernel", whole), (f"rank {a.rank} of cp={a.cp}", run)):
        fn(); fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"== {name}")
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
