"""What each fault does to a real multi-rank run: an error on every surviving rank, a hang, or silence.

    python benchmarks/faults.py                 # every fault
    python benchmarks/faults.py --fault rank_killed_mid_step --deadline 60

Each fault is injected into a training run of the tiny tied GPT on gloo processes (pp2 x dp2; the
plain-layout case at dp2 x cp2) that trains 3 steps with gradsched's DistributedOptimizer, saving after
step 2. The faulty rank is rank 1, at step 2. The ranks run with gloo's default collective timeout (30
minutes, what a job gets unless it says otherwise), so a collective that waits for a peer that never
comes waits past the deadline: that is a hang. One JSON object per fault:

  fault              collective_dropped_on_one_rank  rank 1 skips the optimizer's parameter all-gather
                     extra_collective_on_one_rank    rank 1 issues one all-reduce its peers do not
                     rank_killed_mid_step            rank 1 is SIGKILLed inside the optimizer's all-gather
                     rank_stopped_mid_step           rank 1 is SIGSTOPped there (alive, never answering)
                     rank_exception_mid_step         rank 1 raises inside the optimizer's all-gather
                     rank_killed_mid_save            rank 1 dies while the checkpoint's data is written
                     plain_layout_causal_ring        no fault: causal attention over a ring in the plain layout
                                                     (load_balance=False), Inductor; expected to train like one
                                                     process
  outcome            error (every surviving rank raised before the deadline), hang (some surviving rank was
                     still running at the deadline, and was killed), silent (every rank finished, the results
                     wrong), correct (every rank finished and matched one process)
  seconds_to_error   from the fault (as the faulty rank wrote it down) to the last surviving rank's error;
                     null unless the outcome is error
  surviving_ranks    ranks not killed by the fault
  ranks_with_message surviving ranks whose error names the faulty rank ("rank 1") and what it was waiting for
                     (the collective); gloo's own errors ("Connection closed by peer") name neither, gradsched's
                     journal and watchdog (gradsched.sync.watchdog) name both
  deadline_s         how long the run was given
  messages           the first line of each distinct error; ended_without_result: how each rank that reported
                     nothing ended (its exit code: -9 is SIGKILL, -6 an abort)
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import tempfile
import time

import torch

from common import RESULTS, emit  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from tied_training import Job, gradient_error, rank_main, reference

FAULTY = 1
GLOO_DEFAULT_TIMEOUT_S = 1800.0
FAULTS = ("collective_dropped_on_one_rank", "extra_collective_on_one_rank", "rank_killed_mid_step",
          "rank_stopped_mid_step", "rank_exception_mid_step", "rank_killed_mid_save", "plain_layout_causal_ring")


def _mark(marks: str) -> None:
    """The faulty rank writes down when its fault happens (it may not live to report it)."""
    with open(os.path.join(marks, "fault"), "w") as f:
        f.write(repr(time.time()))


def _inject(fault: str, marks: str) -> None:
    """Arm the fault in this (the faulty) rank: it fires in the optimizer's all-gather at step 2."""
    import torch.distributed as dist
    import gradsched.training.optimizer as optimizer
    gather, calls = optimizer._all_gather, {}

    def at_step_2(out, x, group):
        if not calls.get("armed"):
            return gather(out, x, group)
        calls["armed"] = False
        _mark(marks)
        if fault == "collective_dropped_on_one_rank":
            return None
        if fault == "extra_collective_on_one_rank":
            dist.all_reduce(torch.zeros(1), group=group)
        elif fault == "rank_killed_mid_step":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "rank_stopped_mid_step":  # alive, silent: the launcher's deadline kills it
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "rank_exception_mid_step":
            raise RuntimeError("rank 1: injected fault in the optimizer's all-gather")
        return gather(out, x, group)
    optimizer._all_gather = at_step_2
    return calls


def rank_run(rank: int, world: int, fault: str, marks: str) -> dict:
    import gradsched
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from tied_training import batch
    from tiny_gpt import lm_loss
    job = _job(fault)
    if fault == "plain_layout_causal_ring":
        try:
            return {"result": rank_main(rank, world, job)}
        except Exception as e:  # noqa: BLE001 - the outcome is what we measure
            return {"error": f"{type(e).__name__}: {e}", "at": time.time()}
    calls = _inject(fault, marks) if rank == FAULTY else {}
    from tied_training import build_model
    plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp)
    model, split_points = build_model(job)
    model = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, split_points=split_points, **job.options)
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    _, dp_idx, _ = plan.coords()
    per_rank = job.global_batch // job.dp
    try:
        for step in range(1, job.steps + 1):
            x, y = batch(job, step)
            model.train_step(x[dp_idx * per_rank:(dp_idx + 1) * per_rank], y[dp_idx * per_rank:(dp_idx + 1) * per_rank])
            calls["armed"] = step == 2 and rank == FAULTY and fault != "rank_killed_mid_save"
            opt.step()
            opt.zero_grad()
            if step == 2:
                if fault == "rank_killed_mid_save" and rank == FAULTY:
                    def die_while_writing(self, plan, planner):
                        _mark(marks)
                        os.kill(os.getpid(), signal.SIGKILL)
                    FileSystemWriter.write_data = die_while_writing
                gradsched.save(os.path.join(marks, "ckpt"), model, opt, step=step)
    except BaseException as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "at": time.time()}
    return {"finished": True}


def _job(fault: str) -> Job:
    if fault == "plain_layout_causal_ring":
        return Job(pp=1, dp=2, cp=2, steps=2, optimizer="sgd", lr=0.5,
                   options={"compiler": "inductor", "load_balance": False, "comm": "ring"})
    return Job(pp=2, dp=2, steps=3, options={"compiler": "eager"})


def measure(fault: str, deadline_s: float) -> dict:
    job = _job(fault)
    with tempfile.TemporaryDirectory() as marks:
        t0 = time.time()
        ranks = run_ranks(rank_run, job.world, fault, marks, timeout_s=deadline_s,
                          collective_timeout_s=GLOO_DEFAULT_TIMEOUT_S, raise_on_error=False)
        wall = time.time() - t0
        fault_at = float(open(os.path.join(marks, "fault")).read()) if os.path.exists(
            os.path.join(marks, "fault")) else None
    killed = {r for r, res in enumerate(ranks) if isinstance(res, tuple) and "exited with code" in res[1]}
    if fault == "rank_stopped_mid_step":
        killed.add(FAULTY)  # stopped, then killed at the deadline: not a survivor
    survivors = [r for r in range(job.world) if r not in killed]
    hung = [r for r in survivors if isinstance(ranks[r], tuple) and "timed out" in ranks[r][1]]
    for r in survivors:  # a rank the watchdog ended reported its error itself, with the time
        if isinstance(ranks[r], tuple) and r not in hung:
            ranks[r] = {"error": ranks[r][1], "at": ranks[r][2] if len(ranks[r]) > 2 else t0 + wall}
    errors = {r: ranks[r]["error"] for r in survivors if isinstance(ranks[r], dict) and "error" in ranks[r]}
    row = {"bench": "faults", "fault": fault, "surviving_ranks": len(survivors), "deadline_s": deadline_s,
           "wall_s": round(wall, 1), "seconds_to_error": None,
           "ranks_with_message": sum(1 for m in errors.values()
                                     if re.search(rf"\brank {FAULTY}\b", m) and re.search(r"collective|all_gather|all-gather|waiting", m))}
    if hung:
        row["outcome"] = "hang"
    elif len(errors) == len(survivors):
        row["outcome"] = "error"
        if fault_at is not None:
            row["seconds_to_error"] = round(max(ranks[r]["at"] for r in survivors) - fault_at, 2)
    elif fault == "plain_layout_causal_ring":
        ok = gradient_error(reference(job), [ranks[r]["result"] for r in survivors]) < 1e-5
        row["outcome"] = "correct" if ok else "silent"
    else:
        row["outcome"] = "silent" if not errors else "error"
    row["messages"] = sorted({m.splitlines()[0][:400] for m in errors.values()})
    row["ended_without_result"] = {r: ranks[r][1] for r in sorted(killed)}  # how a rank that reported nothing ended
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--fault", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--deadline", type=float, default=90.0, help="seconds a run gets before it counts as a hang")
    ap.add_argument("--out", default=str(RESULTS / "faults.jsonl"), help="results file ('' for none)")
    args = ap.parse_args(argv)
    for i, fault in enumerate(args.fault):
        emit([measure(fault, args.deadline)], args.out, append=i > 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
