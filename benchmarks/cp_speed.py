"""Speed of context-parallel ring attention: gradsched's ring (Inductor and eager) against torch's.

    python benchmarks/cp_speed.py [--cp 2] [--seq 2048] [--heads 8] [--dim 64] [--dtype fp32]
                                  [--causal | --no-causal] [--iters 10]

Starts --cp gloo processes (gradsched.launch.run_ranks, one thread each). Every rank
builds the same full-sequence q, k, v, grad_out from the seed and keeps its shard in the
load-balanced layout (gradsched.cp.layout; torch's head-tail load balancer cuts the
sequence the same way). Three implementations of forward + backward over those shards:

    gradsched_inductor  torch.compile(fullgraph=True, backend="inductor") of a function
                        calling gradsched.cp.ring_attention.ring_attention; out.backward()
                        runs the Inductor-compiled backward graph (AOTAutograd)
    torch_ring          torch's own ring, the engine of
                        torch.distributed.tensor.experimental.context_parallel:
                        _templated_ring_attention + _templated_ring_attention_backward
                        with the CPU flash op and torch's default options (fp32 merge,
                        head-tail load balancing, all-gather K/V rotation), called directly
                        as torch's tests do: the public context_parallel() has no sharding
                        strategy for the CPU flash op
    gradsched_eager     the same ring_attention call without torch.compile
    gradsched_fast_schedule / gradsched_fewest_roundings   (reduced dtypes only) gradsched_inductor
                        with the schedule the default did not pick (`"schedule"` names each row's):
                        fewest_roundings joins a row's calls with a causal mask (fewer roundings,
                        slower); the default on the CPU kernel only where the fast schedule would
                        round a row's output more than twice (cp > 4) or the call is masked

The limit, measured side by side in the same run: every rank runs the single-device
kernel (forward + backward, same dtype) over the whole sequence for heads/cp of the heads,
all ranks at once between the same barriers. That is one device's work divided by cp,
under the same contention for the machine's cores and memory as the rings; with no
communication and no split of the sequence, no ring can beat it. fraction_of_limit =
limit / median time. The same kernel over all heads in this process alone, before the
ranks start, is the `single_device` row; parallel_efficiency = (its time / cp) / median
time, the issue's measure: on a machine with fewer cores than ranks that limit is not one
the ranks can reach, which is why fraction_of_limit is reported beside it.

Before timing, every rank checks that the three give the same out, dq, dk, dv on its
shard (fp32: rtol 1e-4, atol 1e-5; other dtypes: within a few of that dtype's eps).
Then each iteration runs the three in turn (interleaved, so drift of the machine hits all
alike), each between two barriers; the time of one forward+backward is the wall time
between the barriers (the slowest rank's time). Memory: one more forward+backward per
implementation under torch.profiler(profile_memory=True); the peak of the running sum of
the CPU allocator's allocation/free events over that iteration is the peak of tensor memory
above what was live before it (inputs excluded; saved activations and gradients
included; gloo's own buffers not). Where the profiler gives no memory events, the growth
of ru_maxrss is reported instead; "mem_method" says which.

Schemes side by side (`--comm ring a2a hybrid auto`): one gradsched_inductor row per scheme, all in
the same run and interleaved like the rest (the eager and other-schedule rows are left out then).
`bytes_sent_per_rank` is what one forward+backward makes a rank send to the others, counted from
the collectives the eager call issues (a dispatch mode sees every functional collective and its
tensor): an all-to-all counts the parts for other ranks, an all-gather its input times (n-1), a
reduce-scatter (n-1)/n of its input. The `auto` row names what auto picked and its time against the
best fixed scheme of the run (`auto_vs_best_fixed`).

Skipped work (`--window W`, causal): every scheme runs with the window (torch's ring has none, so it
is left out, and the schemes are checked against each other: the ring's masked blocks and the
all-to-all's masked whole-sequence call share no code); a `no_window` row runs the first scheme
without it. `ring_steps` is the list of ring steps the masked ring runs, as the schedule report
shows it, and `time_vs_no_window` the time it takes against the causal call without the window.

Output: one JSON object per implementation on stdout (also written to
benchmarks/results/cp_speed.jsonl), progress on stderr. fwd_bwd_ms_median is the median
over --iters; ratio_vs_torch_cp is that median over torch_ring's. On this CPU machine
(2 cores shared by all ranks, gloo over loopback) absolute milliseconds mean little and
move from run to run; only the ratios within one run compare the implementations.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gradsched.cp.layout import shard
from gradsched.launch import run_ranks
from gradsched.cp.ring_attention import ring_attention
from gradsched.cp.ring_schedule import fewest_roundings_default

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cp_numerics import DTYPES, torch_ring_attention  # noqa: E402
from cp_numerics import single_process as single_kernel  # noqa: E402
from common import emit  # benchmarks/common.py (the script's folder is on sys.path)
from tied_training import abs_diff  # noqa: E402 - examples/, put on the path by common

OTHER_SCHEDULE = {False: "gradsched_fast_schedule", True: "gradsched_fewest_roundings"}  # by fewest_roundings
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cp_speed.jsonl")


def log(msg: str) -> None:
    print(f"[cp_speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _peak_mb(fn) -> tuple[float, str]:
    """(peak MB of tensor memory above the start while fn runs, how it was measured)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
        if events:
            live = peak = 0
            for _, n in events:
                live += n
                peak = max(peak, live)
            return peak / 2**20, "torch.profiler CPU allocator events (peak live tensor bytes)"
    except (AttributeError, RuntimeError):
        pass
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, "ru_maxrss delta"


class _SentBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes this rank sends to other ranks through functional collectives (see the docstring)."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world, self.sent = rank, world, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None:
            size = x.element_size()
            if name == "all_to_all_single":
                splits, group = args[2], args[3]
                me = dist.get_rank(dist.distributed_c10d._resolve_process_group(group))
                self.sent += (sum(splits) - splits[me]) * (x.numel() // max(sum(splits), 1)) * size
            elif name == "all_gather_into_tensor":
                self.sent += x.numel() * size * (args[1] - 1)
            elif name == "reduce_scatter_tensor":
                self.sent += x.numel() * size * (args[2] - 1) // args[2]
        return func(*args, **(kwargs or {}))


def _sent_bytes(fn, rank, world) -> int:
    with _SentBytes(rank, world) as counter:
        fn()
    return counter.sent


def _rank(rank: int, world: int, cfg: dict):
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    dtype = DTYPES[cfg["dtype"]]
    g = torch.Generator().manual_seed(cfg["seed"])
    shape = lambda h: (cfg["batch"], h, cfg["seq"], cfg["dim"])  # noqa: E731
    q, k, v, dout = (shard(torch.randn(shape(h), generator=g).to(dtype), world, rank, dim=2)
                     for h in (cfg["heads"], cfg["kv_heads"], cfg["kv_heads"], cfg["heads"]))
    causal, comms, window = cfg["causal"], cfg["comms"], cfg["window"]

    def attend_with(comm, window=window, **kw):
        def attend(ql, kl, vl):
            return ring_attention(ql, kl, vl, group, causal=causal, comm=comm, window=window, **kw)
        return attend

    attend = attend_with(comms[0])
    heads = cfg["heads"] // world  # the limit: this rank's share of the heads, whole sequence
    full = [x[:, :h].contiguous() for x, h in zip(
        (torch.randn(shape(cfg["heads"]), generator=g).to(dtype) for _ in range(4)),
        (heads, heads * cfg["kv_heads"] // cfg["heads"], heads * cfg["kv_heads"] // cfg["heads"],
         heads))]

    def limit():
        return single_kernel(*full, causal)

    def gradsched(fn):
        def run():
            ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
            out = fn(ql, kl, vl)
            out.backward(dout)
            return out.detach(), ql.grad, kl.grad, vl.grad
        return run

    compile = lambda fn: torch.compile(fn, fullgraph=True, backend="inductor")  # noqa: E731
    impls = {}
    if window is None:
        impls["torch_ring"] = lambda: torch_ring_attention(q, k, v, dout, causal)
    if len(comms) == 1:
        impls["gradsched_inductor"] = gradsched(compile(attend))
        impls["gradsched_eager"] = gradsched(attend)
        if dtype != torch.float32:  # the option changes nothing in fp32; the row runs the schedule not chosen
            other = not fewest_roundings_default(q.device.type, world, window is not None)
            impls[OTHER_SCHEDULE[other]] = gradsched(compile(attend_with(comms[0], fewest_roundings=other)))
    else:
        impls.update({f"gradsched_inductor:{c}": gradsched(compile(attend_with(c))) for c in comms})
    if window is not None:
        impls["no_window"] = gradsched(compile(attend_with(comms[0], window=None)))

    compile_s = {}
    results = {}
    for name in impls:
        t0 = time.perf_counter()
        results[name] = impls[name]()  # the first call compiles forward and backward
        compile_s[name] = time.perf_counter() - t0
    if rank == 0:
        log("first forward+backward (compiles): " + ", ".join(f"{n} {t:.1f} s" for n, t in compile_s.items()))
    impls["limit"] = limit
    sent = {c: _sent_bytes(gradsched(attend_with(c)), rank, world) for c in comms}
    if window is not None:
        sent["no_window"] = _sent_bytes(gradsched(attend_with(comms[0], window=None)), rank, world)

    # all agree on this rank's shard: against torch's ring, or (with a window) against the first scheme
    ref_name = "torch_ring" if "torch_ring" in results else next(n for n in results if n != "no_window")
    # fp32: elementwise; reduced dtypes: against the tensor's largest value, since a2a rounds as the single
    # device does, not as a ring, and an element near zero (dv summed over many queries) differs by a few ulps
    # of the tensor's scale, not of its own
    diffs = {}
    for name in results:
        if name in (ref_name, "no_window"):
            continue
        for label, a, b in zip(("out", "dq", "dk", "dv"), results[name], results[ref_name]):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {name} "
                                           f"{label} differs from {ref_name}: {m}")
                continue
            err, bound = (a.double() - b.double()).abs().max().item(), 8 * torch.finfo(dtype).eps * b.abs().max().item()
            assert err <= bound, f"rank {rank} {name} {label} differs from {ref_name} by {err:.3g} > {bound:.3g}"
        diffs[name] = max(abs_diff(a.double(), b.double()) for a, b in zip(results[name], results[ref_name]))
    diffs[ref_name] = diffs["limit"] = diffs["no_window"] = 0.0
    if rank == 0:
        log(f"outputs agree (max |diff| vs {ref_name}: "
            f"{', '.join(f'{n} {d:.2g}' for n, d in diffs.items() if n != ref_name)})")

    for _ in range(cfg["warmup"]):
        for fn in impls.values():
            fn()
    times = {name: [] for name in impls}
    for i in range(cfg["iters"]):
        for name, fn in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            log(f"iteration {i + 1}/{cfg['iters']}: "
                + ", ".join(f"{n} {t[-1]:.1f} ms" for n, t in times.items()))
    memory = {}
    for name, fn in impls.items():
        dist.barrier()
        memory[name] = _peak_mb(fn)
    return dict(times=times, memory=memory, diffs=diffs, compile_s=compile_s, sent=sent)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--comm", nargs="+", choices=("ring", "allgather", "a2a", "hybrid", "auto"), default=["ring"],
                   help="gradsched's scheme(s), side by side (torch_ring always uses torch's default)")
    p.add_argument("--window", type=int, default=None, help="sliding window in tokens (causal; see the docstring)")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=RESULTS, help="JSONL file for the results ('' for none)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to the ranks")
    a = p.parse_args(argv)
    if a.seq % (2 * a.cp):
        p.error(f"--seq {a.seq} must be a multiple of 2*cp={2 * a.cp} (load-balanced layout)")
    if a.heads % a.cp or (a.kv_heads or a.heads) % a.cp:
        p.error(f"--heads {a.heads} and --kv-heads must be multiples of cp={a.cp}: the limit "
                "splits the single-device kernel's work by heads")
    if a.window is not None and not a.causal:
        p.error("--window needs causal attention")
    cfg = dict(seq=a.seq, heads=a.heads, kv_heads=a.kv_heads or a.heads, dim=a.dim, batch=a.batch,
               dtype=a.dtype, causal=a.causal, comms=list(dict.fromkeys(a.comm)), window=a.window,
               iters=a.iters, warmup=a.warmup, seed=a.seed)

    torch.set_num_threads(1)  # as each rank runs
    g = torch.Generator().manual_seed(a.seed)
    whole = [torch.randn(a.batch, h, a.seq, a.dim, generator=g).to(DTYPES[a.dtype])
             for h in (a.heads, cfg["kv_heads"], cfg["kv_heads"], a.heads)]
    single_kernel(*whole, a.causal)
    t0 = time.perf_counter()
    single_kernel(*whole, a.causal)
    alone_ms = (time.perf_counter() - t0) * 1e3
    log(f"the kernel over the whole sequence, alone, 1 thread: {alone_ms:.0f} ms")

    t0 = time.perf_counter()
    per_rank = run_ranks(_rank, a.cp, cfg, timeout_s=a.timeout, collective_timeout_s=a.timeout)
    log(f"{a.cp} ranks: {time.perf_counter() - t0:.1f} s in all")

    impls = list(per_rank[0]["times"])
    medians = {n: statistics.median(per_rank[0]["times"][n]) for n in impls}
    from gradsched.cp.comm import choose_comm
    from gradsched.sync.schedule_report import ring_steps
    picked = choose_comm(q_heads=a.heads, kv_heads=cfg["kv_heads"], cp=a.cp, masked=a.window is not None)
    fixed = [medians[f"gradsched_inductor:{c}"] for c in cfg["comms"] if c != "auto" and len(cfg["comms"]) > 1]
    rows = []
    for name in impls:
        comm = name.split(":")[1] if ":" in name else ("allgather (torch default)" if name == "torch_ring"
                                                       else None if name == "limit" else cfg["comms"][0])
        scheme = picked.comm if comm == "auto" else comm
        window = None if name in ("no_window", "torch_ring", "limit") else a.window
        sent_key = "no_window" if name == "no_window" else comm
        row = {
            "bench": "cp_speed", "impl": name, "cp": a.cp, "seq": a.seq, "heads": a.heads,
            "kv_heads": cfg["kv_heads"], "dim": a.dim, "batch": a.batch, "dtype": a.dtype,
            "causal": a.causal, "comm": comm, "window": window, "iters": a.iters,
            "fwd_bwd_ms_median": round(medians[name], 2),
            "fwd_bwd_ms_min": round(min(per_rank[0]["times"][name]), 2),
            "ratio_vs_torch_cp": (round(medians[name] / medians["torch_ring"], 3) if "torch_ring" in medians
                                  else None),
            "fraction_of_limit": round(medians["limit"] / medians[name], 3),
            "parallel_efficiency": round(alone_ms / a.cp / medians[name], 3),
            "full_kernel_ms_alone_over_cp": round(alone_ms / a.cp, 2),
            "bytes_sent_per_rank": (max(r["sent"][sent_key] for r in per_rank)
                                    if sent_key in per_rank[0]["sent"] else None),
            "peak_mem_mb_per_rank": round(max(r["memory"][name][0] for r in per_rank), 2),
            "mem_method": per_rank[0]["memory"][name][1],
            "max_abs_diff_vs_reference": max(r["diffs"][name] for r in per_rank),
            "compile_s": (round(per_rank[0]["compile_s"][name], 1) if name in per_rank[0]["compile_s"]
                          and name.startswith(("gradsched_inductor", "no_window")) else None),
            "device": "cpu, gloo", "torch": torch.__version__,
        }
        if comm == "auto":
            row["auto_picked"] = picked.describe()
            if fixed:
                row["auto_vs_best_fixed"] = round(medians[name] / min(fixed), 3)
        if scheme == "ring" and name not in ("limit", "torch_ring") and a.dtype != "fp32":
            default = fewest_roundings_default("cpu", a.cp, window is not None)
            fewest = not default if name in OTHER_SCHEDULE.values() else default
            row["schedule"] = "fewest_roundings" if fewest else "fast"
        if scheme in ("ring", "hybrid") and name != "limit":
            row["ring_steps"] = ring_steps(a.cp, a.seq // a.cp, a.causal, True, window, scheme,
                                           picked.a2a if comm == "auto" else None,
                                           a.heads, cfg["kv_heads"])
        if window is not None and "no_window" in medians:
            row["time_vs_no_window"] = round(medians[name] / medians["no_window"], 3)
        rows.append(row)
    rows.append({"bench": "cp_speed", "impl": "single_device", "cp": 1, "seq": a.seq, "heads": a.heads,
                 "kv_heads": cfg["kv_heads"], "dim": a.dim, "batch": a.batch, "dtype": a.dtype,
                 "causal": a.causal, "fwd_bwd_ms_median": round(alone_ms, 2), "parallel_efficiency": 1.0,
                 "device": "cpu, one thread, this process alone", "torch": torch.__version__})
    emit(rows, a.out)
    return rows


if __name__ == "__main__":
    main()
