"""How much does an fp32 result cost? The Triton block kernel against aten's flash kernel on
the same blocks, on one GPU.

    python benchmarks/triton_kernel.py [--heads 12] [--dim 128] [--seq 512 4096]

Forward + backward of one block (B=1, bf16 q, k, v), causal (a diagonal square) and full,
timed with CUDA events (median of --iters after warm-up), per implementation:

    flash               aten _scaled_dot_product_flash_attention (+ backward): out, dq, dk, dv in bf16
    triton_fp32         gradsched.cp.triton_attention, precise=False: fp32 out/LSE and dq/dk/dv
                        (accumulate="fp32")
    triton_fp32_blocks  precise=True: P and dS fed as bf16 hi + lo, the rounding floor
                        (accumulate="fp32_blocks")
    efficient_fp32      aten memory-efficient kernel on fp32 operands: what "fp32_blocks" ran
                        before the Triton kernel

Each is timed twice: "eager" (launched from Python, as an eager step runs it) and "cuda_graph"
(the same launches captured once and replayed: the kernels' own time, as a compiled step with
CUDA graphs sees it; small blocks are launch-bound otherwise).

One JSON object per (block, impl, timing) on stdout, with "ms" and "ratio_to_flash"; also
written to benchmarks/results/triton_kernel.jsonl. Target (issue 11): the fp32-output kernel
<= 1.3x flash. --sweep first times each kernel's candidate tiles (gradsched.cp.triton_attention
.CONFIGS) and keeps the fastest. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from common import emit  # benchmarks/common.py

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "triton_kernel.jsonl")


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph (after warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4),
            (64, 128, 4, 3)],
    "dkdv": [(32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4),
             (16, 128, 4, 3)],
    "dq": [(128, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4)],
}


def sweep(heads: int, dim: int, seq: int, iters: int) -> None:
    """Per kernel, the candidate tiles timed on a causal fwd+bwd (others at their current
    choice), keeping the fastest in triton_attention.CONFIGS."""
    from gradsched.cp import triton_attention as ta

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, seq, dim, generator=g, device="cuda")
                     .to(torch.bfloat16) for _ in range(4))
    run = impls(q, k, v, dout, True, dim ** -0.5)["triton_fp32"]
    scale = dim ** -0.5
    ref = efficient_fp32_results(q, k, v, dout, scale)

    def wrong(cfg) -> str | None:
        """A tile is kept only if its results match fp32 attention (bf16 P/dS roundings only):
        guards against a miscompiled tile shape."""
        out, lse = ta.block_forward(q, k, v, True, 0, scale, False)
        got = (out, *ta.block_backward(dout, q, k, v, out, lse, True, 0, scale, False))
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            err = ((g - r).abs().mean() / r.abs().mean()).item()
            if not err < 2e-3:
                return f"{name} relative mean error {err:.2g}"
        return None

    for kernel, options in CANDIDATES.items():
        key = (kernel, dim <= 64)
        default, times = ta.CONFIGS[key], {}
        for cfg in options:
            ta.CONFIGS[key] = cfg
            try:
                bad = wrong(cfg)
                if bad:
                    print(f"sweep {key} {cfg}: rejected, {bad}", file=sys.stderr)
                    continue
                times[cfg] = median_ms(run, iters)
            except Exception as e:  # a tile too large for shared memory
                print(f"sweep {key} {cfg}: {type(e).__name__}", file=sys.stderr)
        ta.CONFIGS[key] = min(times, key=times.get) if times else default
        if not times:
            print(f"sweep {key}: no candidate passed, keeping {default}", file=sys.stderr)
        print(json.dumps({"bench": "triton_kernel_sweep", "kernel": kernel, "dim": dim,
                          "chosen": ta.CONFIGS[key],
                          "ms": {str(c): round(t, 4) for c, t in times.items()}}), flush=True)


def efficient_fp32_results(q, k, v, dout, scale):
    """(out, dq, dk, dv) of the causal block with fp32 operands (aten memory-efficient)."""
    from gradsched.cp.attention_kernels import attend, attend_backward

    qf, kf, vf, df = (x.float() for x in (q, k, v, dout))
    out, lse = attend(qf, kf, vf, True, scale)
    return (out, *attend_backward(df, qf, kf, vf, out, lse, True, scale))


def impls(q, k, v, dout, causal: bool, scale: float) -> dict:
    from gradsched.cp import triton_attention
    from gradsched.cp.attention_kernels import attend, attend_backward

    def flash():
        out, lse = attend(q, k, v, causal, scale)
        attend_backward(dout, q, k, v, out, lse, causal, scale)

    def triton(precise):
        def run():
            out, lse = triton_attention.block_forward(q, k, v, causal, 0, scale, precise)
            triton_attention.block_backward(dout, q, k, v, out, lse, causal, 0, scale, precise)
        return run

    qf, kf, vf, df = (x.float() for x in (q, k, v, dout))

    def efficient_fp32():
        out, lse = attend(qf, kf, vf, causal, scale)
        attend_backward(df, qf, kf, vf, out, lse, causal, scale)

    return {"flash": flash, "triton_fp32": triton(False), "triton_fp32_blocks": triton(True),
            "efficient_fp32": efficient_fp32}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 4096],
                   help="block sizes (rows = keys): 512 is a cp=8 chunk of 4096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--sweep", action="store_true", help="choose each kernel's tiles first")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("triton_kernel.py times GPU kernels: it needs a CUDA device")
    name = torch.cuda.get_device_name()
    if a.sweep:
        for dim in a.dim:
            sweep(a.heads, dim, max(a.seq), a.iters)
    rows = []
    for dim in a.dim:
        for seq in a.seq:
            for causal in (True, False):
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn(1, a.heads, seq, dim, generator=g, device="cuda")
                                 .to(torch.bfloat16) for _ in range(4))
                fns = impls(q, k, v, dout, causal, dim ** -0.5)
                for timing in ("eager", "cuda_graph"):
                    times = {n: median_ms(fn if timing == "eager" else graphed(fn), a.iters)
                             for n, fn in fns.items()}
                    for n, ms in times.items():
                        rows.append({"bench": "triton_kernel", "impl": n, "timing": timing,
                                     "seq": seq, "heads": a.heads, "dim": dim, "causal": causal,
                                     "dtype": "bf16", "fwd_bwd": True, "ms": round(ms, 4),
                                     "ratio_to_flash": round(ms / times["flash"], 3),
                                     "device": name, "torch": torch.__version__})
    emit(rows, a.out)
    return rows


if __name__ == "__main__":
    main()
