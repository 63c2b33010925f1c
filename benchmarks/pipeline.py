"""Pipeline schedules side by side on one tied model: step time, the measured bubble, memory, tie traffic, and
gradients against one process.

    python benchmarks/pipeline.py --pp 2 --microbatches 4 [--plot timeline.png]

The 8-layer tied GPT of benchmarks/memory.py (dim 512, vocab 8192, 64 tokens; the embedding is the LM head,
so the tie spans the first and the last stage), split into pp stages (2 pp for interleaved_1f1b, zbv and
dualpipev, two a rank: in a V the first and the last stage share rank 0, and the tie is one Parameter there) at
block or half-block boundaries: by default where each schedule's ranks are busy alike, from each piece's measured
time, a stage beginning at a block or where its MLP begins (gradsched.balanced_split_points; the head and its loss
cost ~1.5 blocks here, and a V puts them on rank 0 with the embedding), or with --split even the same number of
blocks a stage; one
sequence per micro-batch, the same global batch for every schedule, AdamW. gradsched runs each of its schedules
in one set of pp processes (one thread each), with torch.distributed.pipelining's own
ScheduleInterleavedZeroBubble running the untied copy of the model in eager (the peer: pipelining refuses compiled
stages under it, and torchtitan refuses ties under pipeline parallelism). Every schedule's model is built and
its steps 1 to --warmup run (compiling) first; then the timed steps go in rounds, one step of each schedule a
round, in an order rotated every round (this machine's speed drifts more than the schedules differ: taken in
turns, a drift reaches them alike). Each timed step starts at a barrier. The ranks' malloc keeps freed memory
for reuse (common.keep_freed_memory, as a GPU's caching allocator does): glibc's default page-faulted each
compiled W's gradients back in, ~100K faults a step, which torch's eager backward mostly escaped. One JSON object per schedule:

  split_points              where the stages begin (the same for every rank)
  step_ms_median            median over the timed steps of the slowest rank's step (train_step, optimizer step)
  step_vs_1f1b              step_ms_median / gradsched 1f1b's, from this run
  bubble_fraction           1 - (sum over ranks of the time in forwards, backwards (B, W or whole) and the flush)
                            / (ranks x the pipeline's span), median over the timed steps, from each rank's
                            timestamps (gradsched.training.pipeline_schedule.Timeline): what the ranks spent
                            waiting. The span is the slowest rank's train_step (the schedule and the flush), from
                            the step's barrier: the optimizer's step after it is no part of the pipeline's bubble
                            (counted in, it made every schedule's bubble look larger by the same time)
  peak_bytes_per_rank       the most bytes alive above the step's start during one more step, the largest over
                            ranks (every thread's allocations and frees, benchmarks/cpu_peak.py)
  tie_bytes_per_step        bytes the tie all-reduce moves per step on a rank (0 for the untied peer)
  max_rel_grad_diff_vs_one_process   the first step's reduced gradients against the unsplit model's in one
                            process (fp32), relative to its largest gradient

On this CPU the ranks share 2 cores: ratios from one run only, absolute times only from a GPU machine.
--plot draws one step of each schedule, a row per rank: forwards, B, W (or whole backwards) and the flush.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

import cpu_peak  # benchmarks/cpu_peak.py: every thread's allocations and frees
from common import RESULTS, emit, keep_freed_memory  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from gradsched.training.pipeline_schedule import Timeline
from tied_training import Job, batch, build_model, gradient_error, reduced_gradients, reference
from tiny_gpt import GPTConfig, lm_loss

CONFIG = GPTConfig(vocab=8192, seq=64, dim=512, heads=8, layers=8)
SCHEDULES = ("1f1b", "gpipe", "zb1p", "interleaved_1f1b", "zbv", "dualpipev")
SEVERAL = ("interleaved_1f1b", "zbv", "dualpipev")  # two stages a rank: the model split in 2 pp stages
PEER = "torch_zb1p_eager_untied"
WORK = ("F", "B", "W", "BW", "sync")


def job_for(pp: int, m: int, schedule: str, compiler: str, variant: str = "") -> Job:
    stages = pp * (2 if schedule in SEVERAL else 1)
    every = CONFIG.layers // stages
    return Job(pp=pp, dp=1, steps=1, global_batch=m, config=CONFIG, optimizer="adamw", variant=variant,
               split_points=tuple(f"blocks.{i * every}" for i in range(1, stages)), schedule=schedule,
               options={"compiler": compiler})


class Runner:
    """One schedule's model in this rank: `run_step(step)` runs a step (returning when its schedule and flush
    ended), `timeline` records its spans; the timed steps' records gather in `steps`."""

    def __init__(self, run_step, timeline: Timeline, extra: dict):
        self.run_step, self.timeline, self.extra = run_step, timeline, extra
        self.times, self.steps = [], []

    def step(self, step: int, timed: bool) -> None:
        import torch.distributed as dist
        dist.barrier()
        self.timeline.events, self.timeline.on = [], timed
        t0 = time.perf_counter()
        scheduled = self.run_step(step)  # when the schedule and its flush ended (the optimizer's step follows)
        t1 = time.perf_counter()
        self.timeline.on = False
        if timed:
            self.times.append(t1 - t0)
            self.steps.append({"start": t0, "end": t1, "scheduled": scheduled, "events": list(self.timeline.events)})


def _timed(rank, runners: dict, a) -> dict:
    """The timed steps taken in turns, one step of each schedule a round, the order rotated every round: this
    machine's speed drifts by more than the schedules differ (the same step's matrix products took 15% longer in
    one phase of a run than in another), and a drift then reaches every schedule alike. Then one more step each,
    its peak measured."""
    import torch.distributed as dist
    names = list(runners)
    for t in range(a.steps):
        for name in names[t % len(names):] + names[:t % len(names)]:
            runners[name].step(a.warmup + t, timed=True)
    out = {}
    for name, r in runners.items():
        dist.barrier()
        cpu_peak.reset()
        r.run_step(a.warmup + a.steps)
        out[name] = {"rank": rank, "step_times": r.times, "steps": r.steps, "peak": cpu_peak.peak(), **r.extra}
    return out


def split_for(model, job: Job, a) -> tuple:
    """--split balanced: the split points that balance the ranks for the job's schedule, measured on this
    model (gradsched.balanced_split_points: every rank the same), a stage beginning at a block or at its MLP;
    even: every stage the same number of blocks."""
    if a.split == "even":
        return job.split_points
    import gradsched
    x, y = batch(job, 0)
    # every block, and where each block's MLP begins (its second norm): cut at blocks alone, the V of this 8-layer
    # model over 2 ranks is at best 0.8 of a block out of balance (the head costs ~1.5 blocks)
    candidates = [c for i in range(CONFIG.layers) for c in ((f"blocks.{i}",) if i else ()) + (f"blocks.{i}.ln2",)]
    return gradsched.balanced_split_points(model, (x[:1],), y[:1], lm_loss, candidates, a.pp, job.schedule,
                                           compiler=a.compiler, microbatches=a.microbatches)


def _gradsched(rank, schedule: str, a) -> dict:
    import gradsched
    job = job_for(a.pp, a.microbatches, schedule, a.compiler)
    model, _ = build_model(job)
    split_points = split_for(model, job, a)
    plan = gradsched.ParallelPlan.from_world(pp=a.pp)
    pm = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, split_points=split_points, schedule=schedule,
                               microbatches=a.microbatches, compiler=a.compiler)
    opt = gradsched.DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    grads = {}

    def run_step(step):
        x, y = batch(job, step)
        pm.train_step(x, y)
        scheduled = time.perf_counter()
        if step == 0:
            grads.update(reduced_gradients(pm.grad_sync))
        opt.step()
        opt.zero_grad()
        return scheduled
    runner = Runner(run_step, pm.timeline, {"grads": grads, "split": split_points})
    for step in range(a.warmup):  # compiled here, each schedule in turn
        runner.step(step, timed=False)
    runner.extra["tie_bytes"] = pm.grad_sync.tied_bytes_per_step()
    return runner


def _peer(rank, a) -> dict:
    """pipelining's ZB-H1 over the untied model, eager, with its own split backward."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, SplitPoint, pipeline
    job = job_for(a.pp, a.microbatches, "zb1p", "eager", variant="untied")
    model, _ = build_model(job)
    split_points = split_for(model, job, a)
    x0, _ = batch(job, 0)
    pipe = pipeline(model, mb_args=(x0[:1],), split_spec={p: SplitPoint.BEGINNING for p in split_points})
    module = pipe.get_stage_module(rank)
    timeline = Timeline()

    class Stage(PipelineStage):
        def forward_one_chunk(self, i, *args, **kw):
            with timeline.span("F", i):
                return super().forward_one_chunk(i, *args, **kw)

        def backward_one_chunk(self, i, loss=None, full_backward=True, last_backward=False):
            with timeline.span("BW" if full_backward else "B", i):
                return super().backward_one_chunk(i, loss, full_backward, last_backward)

        def backward_weight_one_chunk(self, i, last_backward=False):
            with timeline.span("W", i):
                return super().backward_weight_one_chunk(i, last_backward)
    stage = Stage(module, rank, a.pp, torch.device("cpu"), group=dist.group.WORLD)
    schedule = ScheduleInterleavedZeroBubble([stage], n_microbatches=a.microbatches, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    grads = {}

    def run_step(step):
        x, y = batch(job, step)
        schedule.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == a.pp - 1 else {}))
        scheduled = time.perf_counter()
        if step == 0:
            grads["full"] = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
        opt.step()
        opt.zero_grad()
        return scheduled
    runner = Runner(run_step, timeline, {"grads": grads, "tie_bytes": 0, "split": split_points})
    for step in range(a.warmup):
        runner.step(step, timed=False)
    return runner


def bench_rank(rank: int, world: int, a) -> dict:
    cpu_peak.install()
    torch.manual_seed(0)
    runners = {schedule: _gradsched(rank, schedule, a) for schedule in a.schedules}
    if a.peer:
        runners[PEER] = _peer(rank, a)
    return _timed(rank, runners, a)


def bubble(ranks: list[dict]) -> float:
    """Median over the timed steps of 1 - busy / (ranks x the slowest rank's schedule span)."""
    fractions = []
    for per_rank in zip(*(r["steps"] for r in ranks)):
        span = max(s["scheduled"] - s["start"] for s in per_rank)
        busy = sum(t1 - t0 for s in per_rank for kind, _, t0, t1 in s["events"] if kind in WORK)
        fractions.append(1 - busy / (len(per_rank) * span))
    return statistics.median(fractions)


def plot(results: dict, pp: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"F": "#4878d0", "B": "#ee854a", "W": "#6acc64", "BW": "#d65f5f", "sync": "#956cb4"}
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.1 * pp * len(results) + 1), squeeze=False)
    for ax, (name, ranks) in zip(axes[:, 0], results.items()):
        start = min(r["steps"][-1]["start"] for r in ranks)  # the last timed step, from its barrier
        for r in ranks:
            for kind, mb, t0, t1 in r["steps"][-1]["events"]:
                ax.barh(r["rank"], (t1 - t0) * 1e3, left=(t0 - start) * 1e3, color=colors[kind], edgecolor="white")
                if kind != "sync":
                    ax.text((t0 + t1 - 2 * start) * 5e2, r["rank"], str(mb), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(pp), [f"rank {i}" for i in range(pp)])
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the step's barrier")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["forward", "B (inputs' grads)", "W (weights' grads)", "whole backward", "flush"],
               loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=9, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--no-peer", dest="peer", action="store_false", help="skip pipelining's own ZB-H1")
    ap.add_argument("--split", default="balanced", choices=("balanced", "even"),
                    help="stages by measured time for each schedule's placement, cut at blocks or half blocks (default), "
                    "or the same blocks each")
    ap.add_argument("--plot", default="", help="write one step's timeline per schedule to this PNG")
    ap.add_argument("--out", default=None, help="results file ('' for none); default benchmarks/results/"
                    "pipeline_pp{pp}_m{microbatches}.jsonl")
    a = ap.parse_args()
    if "1f1b" not in a.schedules:
        ap.error("--schedules must include 1f1b: every ratio is to it")
    if CONFIG.layers % (2 * a.pp if set(a.schedules) & set(SEVERAL) else a.pp):
        ap.error(f"--pp {a.pp} (x 2 stages a rank for {SEVERAL}) does not divide the model's {CONFIG.layers} layers")
    cpu_peak.build()  # compiled once here, before the ranks load it
    keep_freed_memory()  # before the ranks start: they inherit it
    per_rank = run_ranks(bench_rank, a.pp, a, timeout_s=3000, collective_timeout_s=600)
    results = {name: [r[name] for r in per_rank] for name in per_rank[0]}
    refs = {v: reference(job_for(a.pp, a.microbatches, "1f1b", "eager", variant=v)) for v in ("", "untied")}
    rows = []
    for name, ranks in results.items():
        step = statistics.median(max(s) for s in zip(*(r["step_times"] for r in ranks)))
        rows.append({"bench": "pipeline", "schedule": name, "pp": a.pp, "microbatches": a.microbatches,
                     "compiler": "eager" if name == PEER else a.compiler, "split_points": list(ranks[0]["split"]),
                     "step_ms_median": round(step * 1e3, 1),
                     "bubble_fraction": round(bubble(ranks), 4),
                     "peak_bytes_per_rank": max(r["peak"] for r in ranks),
                     "tie_bytes_per_step": max(r["tie_bytes"] for r in ranks),
                     "max_rel_grad_diff_vs_one_process": gradient_error(refs["untied" if name == PEER else ""],
                                                                         [r for r in ranks])})
    base = next(r["step_ms_median"] for r in rows if r["schedule"] == "1f1b")
    for r in rows:
        r["step_vs_1f1b"] = round(r["step_ms_median"] / base, 3)
    emit(rows, a.out if a.out is not None else RESULTS / f"pipeline_pp{a.pp}_m{a.microbatches}.jsonl")
    if a.plot:
        plot(results, a.pp, a.plot)


if __name__ == "__main__":
    main()
