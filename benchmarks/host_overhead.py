"""Host overhead of a training step: gradsched against DDP and FSDP2 (each under torch.compile), with a model so
small that its compute is negligible, so what is left is what the CPU spends driving the step.

    python benchmarks/host_overhead.py --pp 1 --dp 2
    python benchmarks/host_overhead.py --pp 2 --dp 2

A 2-layer GPT (dim 64), 8 micro-batches of one sequence per rank, AdamW. gradsched runs pp x dp with Inductor
(its pipeline at pp 2); DDP (torch.compile over DistributedDataParallel, no_sync but on the last micro-batch)
and FSDP2 (fully_shard per block and at the root, torch.compile, gradient sync on the last micro-batch only)
run the same pp x dp processes as plain data parallel, each rank with the same 8 micro-batches. All of them run
on the same processes, their steps interleaved (a step of each in turn: the machine's own noise falls on all
alike). Steps 1 to 4 warm up (compiles); steps 5 to 25 are timed; then 5 more of each run under cProfile. The
processes' malloc keeps freed memory for reuse (common.keep_freed_memory), as a GPU's caching allocator does.
gradsched_allreduce is gradsched with shard=False (the gradients all-reduced, as DDP does). One JSON object per
implementation:

  step_ms_median          median over the timed steps of the slowest rank's step (train_step or the
                          micro-batches' forward and backward, then optimizer step and zero_grad)
  vs_ddp                  step_ms_median / DDP's, from this run
  host_ms_per_microbatch  the implementation's own Python per micro-batch, from a profile on the main thread's
                          CPU clock: the self time of its functions (gradsched/, DDP's or FSDP2's modules) and
                          of the C calls they make directly (the tensor ops of its checks; not collectives or
                          their waits, which block the host on gloo only), over the profiled steps'
                          micro-batches, plus for gradsched its watchdog thread's CPU time; the largest over
                          ranks. cProfile slows every Python call it sees: an upper bound.
  host_wall_ms_per_microbatch    the same on the wall clock (5 more steps): it also holds the time the process
                          waited for a core or for the GIL, charged to whatever function ran (4 processes on
                          2 cores: it moves with the machine's load more than with the code)
  pipelining_ms_per_microbatch   (gradsched at pp > 1) the same for torch.distributed.pipelining's schedule
                          (and pipelining_wall_ms_per_microbatch)
  watchdog_ms_per_step    (gradsched) its watchdog thread's CPU time per step

On this CPU every process shares 2 cores with the others: ratios from one run only; absolute times only from
a GPU machine, with the device named.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

from common import RESULTS, emit, keep_freed_memory  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from tied_training import Job, batch, build_model
from tiny_gpt import GPTConfig, lm_loss

IMPLS = ("gradsched", "gradsched_allreduce", "ddp", "fsdp2")  # gradsched_allreduce: shard=False, as DDP reduces
CONFIG = GPTConfig(vocab=64, seq=16, dim=64, heads=4, layers=2)
MICROBATCHES, WARMUP, TIMED, PROFILED = 8, 4, 21, 5  # PROFILED steps on each clock
OWN = {"gradsched": ("/gradsched/",), "gradsched_allreduce": ("/gradsched/",),
       "ddp": ("torch/nn/parallel/distributed.py",),
       "fsdp2": ("torch/distributed/fsdp/",), "pipelining": ("torch/distributed/pipelining/",)}


class Trainer:
    def __init__(self, impl: str, job: Job):
        import torch.distributed as dist
        model, split_points = build_model(job)
        self.impl, self.m = impl, MICROBATCHES
        if impl.startswith("gradsched"):
            import gradsched
            self.plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp)
            self.model = gradsched.parallelize(model, plan=self.plan, loss_fn=lm_loss, microbatches=self.m,
                                               split_points=split_points if job.pp > 1 else (), compiler="inductor",
                                               shard=impl == "gradsched")
            self.opt = gradsched.DistributedOptimizer(self.model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
            self.dp_idx = self.plan.index("dp")
            return
        if impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        self.forward = torch.compile(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        self.dp_idx = dist.get_rank()

    def step(self, x, y) -> None:
        if self.impl.startswith("gradsched"):
            self.model.train_step(x, y)
        else:
            for i, (xi, yi) in enumerate(zip(x.chunk(self.m), y.chunk(self.m))):
                last = i == self.m - 1
                if self.impl == "fsdp2":
                    self.model.set_requires_gradient_sync(last)
                    (lm_loss(self.forward(xi), yi) / self.m).backward()
                elif last:
                    (lm_loss(self.forward(xi), yi) / self.m).backward()
                else:
                    with self.model.no_sync():
                        (lm_loss(self.forward(xi), yi) / self.m).backward()
        self.opt.step()
        self.opt.zero_grad()


def own_entries(stats: pstats.Stats, paths: tuple) -> dict:
    """Self time in ms of each function in `paths`, and of each C call they make directly (charged to its
    caller); a collective or a wait for one is communication (on gloo it blocks the host), not host overhead:
    left out."""
    mine = lambda func: any(p in func[0].replace("\\", "/") for p in paths)  # noqa: E731
    out = {}
    for func, (_, _, tt, _, callers) in stats.stats.items():
        if mine(func):
            out[func] = out.get(func, 0.0) + 1e3 * tt
        elif func[0] == "~" and "c10d" not in func[2]:  # a built-in: what these functions' calls to it took
            for caller, c in callers.items():
                if mine(caller):
                    out[caller] = out.get(caller, 0.0) + 1e3 * c[2]
    return out


def own_ms(stats: pstats.Stats, paths: tuple) -> float:
    return sum(own_entries(stats, paths).values())


def watchdog_cpu_s() -> float:
    from gradsched.sync.watchdog import JOURNAL
    thread = JOURNAL.thread
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):  # the thread ended, or no per-thread clock on this platform
        return 0.0


def rank_run(rank: int, world: int, impls: list, jobs: dict, top: int = 0) -> dict:
    """Every implementation on these processes, their timed steps interleaved (one step of each in turn), so that
    whatever else the machine does falls on all of them alike; then each profiled on its own."""
    trainers = {impl: Trainer(impl, jobs[impl]) for impl in impls}

    def step(impl, i):
        trainer, job = trainers[impl], jobs[impl]
        per_rank = job.global_batch // (job.dp if impl.startswith("gradsched") else world)
        sl = slice(trainer.dp_idx * per_rank, (trainer.dp_idx + 1) * per_rank)
        x, y = batch(job, i)
        t0 = time.perf_counter()
        trainer.step(x[sl], y[sl])
        return time.perf_counter() - t0

    times = {impl: [] for impl in impls}
    for i in range(WARMUP + TIMED):
        for impl in impls:
            times[impl].append(step(impl, i))
    out = {}
    for impl in impls:
        # twice: on the wall clock, and on this thread's CPU clock (time.thread_time), which leaves out the time
        # the process waited for a core or for the GIL (4 processes on 2 cores: stalls charged to whatever ran)
        stats, watchdog_ms, per_mb = {}, 0.0, PROFILED * MICROBATCHES
        for clock, timer in (("wall", time.perf_counter), ("cpu", time.thread_time)):
            watch0, prof = watchdog_cpu_s(), cProfile.Profile(timer)
            prof.enable()
            for i in range(PROFILED):
                step(impl, WARMUP + TIMED + i + (PROFILED if clock == "cpu" else 0))
            prof.disable()
            watchdog_ms += 1e3 * (watchdog_cpu_s() - watch0) / (2 * PROFILED) if impl.startswith("gradsched") else 0.0
            stats[clock] = pstats.Stats(prof)
        out[impl] = {"step_times": times[impl][WARMUP:], "watchdog_ms_per_step": watchdog_ms,
                     **{f"{name}_{clock}": own_ms(stats[clock], OWN[key]) / per_mb + (
                         watchdog_ms / MICROBATCHES if name == "own" else 0.0)
                        for name, key in (("own", impl), ("pipelining", "pipelining")) for clock in stats},
                     "top": sorted(((f"{f[0].rsplit('/', 2)[-1]}:{f[1]}({f[2]})", ms / per_mb)
                                    for f, ms in own_entries(stats["cpu"], OWN[impl]).items()),
                                   key=lambda e: -e[1])[:top]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2), help="gradsched's pipeline stages")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--out", default=None, help="results file ('' for none); default benchmarks/results/"
                    "host_overhead_pp{pp}_dp{dp}.jsonl")
    ap.add_argument("--top", type=int, default=0, help="print each rank's N costliest own functions (self time "
                    "and direct C calls, ms per micro-batch) to stderr")
    args = ap.parse_args(argv)
    world = args.pp * args.dp
    # every rank runs 8 micro-batches of one sequence; DDP and FSDP2 spread the global batch over every process
    job = Job(pp=args.pp, dp=args.dp, global_batch=MICROBATCHES * world if args.pp == 1 else MICROBATCHES * args.dp,
              config=CONFIG, split_points=("blocks.1",))
    out = args.out if args.out is not None else RESULTS / f"host_overhead_pp{args.pp}_dp{args.dp}.jsonl"
    # DDP first (the others' ratio), interleaved with each other implementation on one set of processes: FSDP2's
    # per-block compiles and gradsched's whole-stage ones do not share processes (Dynamo's caches are per code
    # object, and fully_shard's hooks break the model's graph for every compile of it)
    others = [i for i in args.impl if i != "ddp"] or ["ddp"]
    keep_freed_memory()  # every implementation's processes alike: malloc reuses what it freed, as on a GPU
    rows = []
    for other in others:
        impls = ["ddp"] + ([other] if other != "ddp" else [])
        whole = Job(**{**job.__dict__, "global_batch": MICROBATCHES * world})  # DDP and FSDP2: every process a replica
        jobs = {impl: job if impl.startswith("gradsched") else whole for impl in impls}
        print(f"host_overhead.py: {' and '.join(impls)} on the same {world} processes, steps interleaved ...",
              flush=True)
        ranks = run_ranks(rank_run, world, impls, jobs, args.top, timeout_s=1800)
        for rank, r in enumerate(ranks):
            for impl in impls if args.top else ():
                print(f"rank {rank} {impl}: " + "; ".join(f"{name} {ms:.3f}" for name, ms in r[impl]["top"]),
                      file=sys.stderr)
        ddp_ms = None
        for impl in impls:
            per_rank = [r[impl] for r in ranks]
            step_ms = 1e3 * statistics.median(max(s) for s in zip(*(r["step_times"] for r in per_rank)))
            ddp_ms = step_ms if impl == "ddp" else ddp_ms
            if impl == "ddp" and any(r["impl"] == "ddp" for r in rows):
                continue  # one DDP row, the first run's; each run's ratio is to its own DDP
            mine = impl.startswith("gradsched")
            row = {"bench": "host_overhead", "impl": impl, "pp": args.pp if mine else 1,
                   "dp": args.dp if mine else world, "processes": world, "microbatches": MICROBATCHES,
                   "device": "cpu", "step_ms_median": round(step_ms, 2),
                   "vs_ddp": round(step_ms / ddp_ms, 3) if ddp_ms else None,
                   "host_ms_per_microbatch": round(max(r["own_cpu"] for r in per_rank), 3),
                   "host_wall_ms_per_microbatch": round(max(r["own_wall"] for r in per_rank), 3)}
            if mine:
                row["pipelining_ms_per_microbatch"] = round(max(r["pipelining_cpu"] for r in per_rank), 3)
                row["pipelining_wall_ms_per_microbatch"] = round(max(r["pipelining_wall"] for r in per_rank), 3)
                row["watchdog_ms_per_step"] = round(max(r["watchdog_ms_per_step"] for r in per_rank), 3)
            rows.append(row)
            emit(rows[-1:], out, append=len(rows) > 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
