"""What each fault does to a real multi-rank run: an error on every surviving rank, a hang, or silence.

    python benchmarks/faults.py                 # every fault
    python benchmarks/faults.py --fault rank_killed_mid_step --deadline 60

Each fault is injected into a training run of the tiny tied GPT on gloo processes (pp2 x dp2; the
plain-layout case at dp2 x cp2) that trains 3 steps with gradsched's DistributedOptimizer, saving after
step 2. The faulty rank is rank 1, at step 2 (step 1 for the batch shape). The ranks run with gloo's
default collective timeout (30 minutes, what a job gets unless it says otherwise), so a collective that
waits for a peer that never comes waits past the deadline: that is a hang. gradsched's own
fault_timeout_s is its default (30 s; --fault-timeout). One JSON object per fault:

  fault              collective_dropped_on_one_rank  rank 1 skips the optimizer's parameter all-gather
                     extra_collective_on_one_rank    rank 1 issues one all-reduce its peers do not
                     rank_killed_mid_step            rank 1 is SIGKILLed inside the optimizer's all-gather
                     rank_stopped_mid_step           rank 1 is SIGSTOPped there (alive, never answering)
                     rank_exception_mid_step         rank 1 raises inside the optimizer's all-gather
                     rank_killed_mid_save            rank 1 dies while the checkpoint's data is written
                     replica_seed_mismatch           rank 1 builds its model from another seed (expected: correct,
                                                     every replica starts from its group's first rank's values)
                     replica_structure_mismatch      rank 1's model has another vocabulary size
                     nonfinite_activation_on_one_rank      rank 1 puts one NaN in the activations it sends to the
                                                     next stage (on_nonfinite="raise")
                     nonfinite_activation_on_one_rank_skip the same with on_nonfinite="skip" (expected: skipped,
                                                     every rank skips step 2 and ends like one process that did)
                     rank_stuck_in_python            rank 1 loops forever in Python between train_step and opt.step
                     rank_sleeping                   rank 1 sleeps (an hour) in its stage's backward
                     straggler_within_timeout        rank 1 is late by half of fault_timeout_s in the optimizer's
                                                     all-gather (expected: correct)
                     straggler_beyond_timeout        rank 1 is late by fault_timeout_s + 15 s there
                     batch_shape_mismatch_first_step rank 1's first batch is 4 tokens shorter
                     rank_exits_zero                 rank 1 calls sys.exit(0) after its second train_step
                     plain_layout_causal_ring        no fault: causal attention over a ring in the plain layout
                                                     (load_balance=False), Inductor; expected to train like one
                                                     process
  outcome            error (every surviving rank raised before the deadline), hang (some surviving rank was
                     still running at the deadline, and was killed), silent (every rank finished, the results
                     wrong), correct (every rank finished and matched one process), skipped (every rank skipped
                     the faulty step and matched one process that skipped it)
  seconds_to_error   from the fault (as the faulty rank wrote it down) to the last surviving rank's error;
                     null unless the outcome is error
  surviving_ranks    ranks not killed by the fault (a rank that left by itself is not one)
  ranks_with_message surviving ranks whose error names the faulty rank ("rank 1"); gloo's own errors
                     ("Connection closed by peer") name none, gradsched's journal and watchdog
                     (gradsched.sync.watchdog) do
  cpp_trace          whether any survivor's message holds a C++ stack trace ("frame #")
  deadline_s         how long the run was given
  messages           the first line of each distinct error; ended_without_result: how each rank that reported
                     nothing ended (its exit code: -9 is SIGKILL, -6 an abort)
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import replace

import torch

from common import RESULTS, emit  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from tied_training import Job, compare, gradient_error, optimizer_class, optimizer_kwargs, rank_main, reference

FAULTY = 1
GLOO_DEFAULT_TIMEOUT_S = 1800.0
FAULTS = ("collective_dropped_on_one_rank", "extra_collective_on_one_rank", "rank_killed_mid_step",
          "rank_stopped_mid_step", "rank_exception_mid_step", "rank_killed_mid_save", "replica_seed_mismatch",
          "replica_structure_mismatch", "nonfinite_activation_on_one_rank", "nonfinite_activation_on_one_rank_skip",
          "rank_stuck_in_python", "rank_sleeping", "straggler_within_timeout", "straggler_beyond_timeout",
          "batch_shape_mismatch_first_step", "rank_exits_zero", "plain_layout_causal_ring")
IN_THE_GATHER = ("collective_dropped_on_one_rank", "extra_collective_on_one_rank", "rank_killed_mid_step",
                 "rank_stopped_mid_step", "rank_exception_mid_step", "straggler_within_timeout",
                 "straggler_beyond_timeout")
EXPECTED = {"replica_seed_mismatch": "correct", "straggler_within_timeout": "correct",
            "nonfinite_activation_on_one_rank_skip": "skipped", "plain_layout_causal_ring": "correct"}


def _mark(marks: str) -> None:
    """The faulty rank writes down when its fault happens (it may not live to report it)."""
    with open(os.path.join(marks, "fault"), "w") as f:
        f.write(repr(time.time()))


def _inject_in_the_gather(fault: str, marks: str, timeout_s: float) -> dict:
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
        elif fault == "straggler_within_timeout":
            time.sleep(timeout_s / 2)
        elif fault == "straggler_beyond_timeout":
            time.sleep(timeout_s + 15)
        return gather(out, x, group)
    optimizer._all_gather = at_step_2
    return calls


def _inject_in_the_stage(fault: str, marks: str) -> dict:
    """Arm a fault in this rank's pipeline stage (torch's PipelineStage, under gradsched's): at step 2, a NaN
    in the first activation it sends, or an hour's sleep in its first backward."""
    from torch.distributed.pipelining.stage import PipelineStage
    calls = {}
    forward, backward = PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk

    def nan_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if calls.get("armed"):
            calls["armed"] = False
            _mark(marks)
            with torch.no_grad():
                (out[0] if isinstance(out, tuple) else out).view(-1)[0] = float("nan")
        return out

    def sleepy_backward(self, *args, **kwargs):
        if calls.get("armed"):
            calls["armed"] = False
            _mark(marks)
            time.sleep(3600)
        return backward(self, *args, **kwargs)
    if fault.startswith("nonfinite_activation"):
        PipelineStage.forward_one_chunk = nan_forward
    else:
        PipelineStage.backward_one_chunk = sleepy_backward
    return calls


def rank_run(rank: int, world: int, fault: str, marks: str, timeout_s: float) -> dict:
    import gradsched
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from tied_training import batch, build_model, reduced_gradients
    from tiny_gpt import lm_loss
    job = _job(fault, timeout_s)
    if fault == "plain_layout_causal_ring":
        try:
            return {"result": rank_main(rank, world, job)}
        except Exception as e:  # noqa: BLE001 - the outcome is what we measure
            return {"error": f"{type(e).__name__}: {e}", "at": time.time()}
    faulty = rank == FAULTY
    calls = {}
    if faulty and fault in IN_THE_GATHER:
        calls = _inject_in_the_gather(fault, marks, timeout_s)
    elif faulty and (fault.startswith("nonfinite_activation") or fault == "rank_sleeping"):
        calls = _inject_in_the_stage(fault, marks)
    built = job
    if faulty and fault.startswith("replica_"):
        _mark(marks)
    if faulty and fault == "replica_seed_mismatch":
        built = replace(job, seed=job.seed + 1)
    elif faulty and fault == "replica_structure_mismatch":
        built = replace(job, config=replace(job.config, vocab=job.config.vocab + 8))
    plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp)
    model, split_points = build_model(built)
    model = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, split_points=split_points, **job.options)
    opt = gradsched.DistributedOptimizer(model, optimizer_class(job), **optimizer_kwargs(job))
    dp_idx = plan.index("dp")
    per_rank = job.global_batch // job.dp
    grads = None
    try:
        for i in range(job.steps):
            step = i + 1
            x, y = batch(job, i)
            x, y = x[dp_idx * per_rank:(dp_idx + 1) * per_rank], y[dp_idx * per_rank:(dp_idx + 1) * per_rank]
            if faulty and fault == "batch_shape_mismatch_first_step" and step == 1:
                _mark(marks)
                x, y = x[:, :-4], y[:, :-4]
            calls["armed"] = faulty and step == 2 and fault not in IN_THE_GATHER
            model.train_step(x, y)
            if i == 0:
                grads = reduced_gradients(model.grad_sync)
            if faulty and step == 2 and fault == "rank_stuck_in_python":
                _mark(marks)
                while True:
                    pass
            if faulty and step == 2 and fault == "rank_exits_zero":
                _mark(marks)
                sys.exit(0)
            calls["armed"] = step == 2 and faulty and fault in IN_THE_GATHER
            opt.step()
            opt.zero_grad()
            if step == 2:
                if fault == "rank_killed_mid_save" and faulty:
                    def die_while_writing(self, plan, planner):
                        _mark(marks)
                        os.kill(os.getpid(), signal.SIGKILL)
                    FileSystemWriter.write_data = die_while_writing
                gradsched.save(os.path.join(marks, "ckpt"), model, opt, step=step)
    except SystemExit:
        raise  # the rank leaves (rank_exits_zero)
    except BaseException as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "at": time.time()}
    sync = model.grad_sync
    return {"finished": True, "skipped": opt.skipped_steps, "grads": grads, "rank": rank, "stage": plan.stage,
            "dp_idx": dp_idx, "params": {n: v.clone() for n, v in sync.full_parameters().items()},
            "ties": [t.members for t in sync.ties.values()]}


def _job(fault: str, timeout_s: float) -> Job:
    if fault == "plain_layout_causal_ring":
        return Job(pp=1, dp=2, cp=2, steps=2, optimizer="sgd", lr=0.5,
                   options={"compiler": "inductor", "load_balance": False, "comm": "ring"})
    options = {"compiler": "eager", "fault_timeout_s": timeout_s}
    if fault == "nonfinite_activation_on_one_rank_skip":
        options["on_nonfinite"] = "skip"
    return Job(pp=2, dp=2, steps=3, options=options)


def reference_skipping(job: Job, skip: int) -> dict:
    """One process, the unsplit model, the step at index `skip` computed and not applied."""
    from tied_training import batch, build_model
    from tiny_gpt import lm_loss
    model, _ = build_model(job)
    opt = optimizer_class(job)(model.parameters(), **optimizer_kwargs(job))
    for i in range(job.steps):
        x, y = batch(job, i)
        lm_loss(model(x), y).backward()
        if i != skip:
            opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
            "aliases": []}


def _matches_one_process(fault: str, job: Job, results: list) -> tuple[bool, float]:
    """(whether every rank's results match one process, the largest parameter difference)."""
    if fault == "plain_layout_causal_ring":
        return gradient_error(reference(job), [r["result"] for r in results]) < 1e-5, float("nan")
    if fault == "nonfinite_activation_on_one_rank_skip":
        ref = reference_skipping(job, skip=1)
        diff = compare(ref, results)["max_abs_diff"]
        return all(r["skipped"] == 1 for r in results) and diff < 1e-5, diff
    ref = reference(job)
    diff = compare(ref, results)["max_abs_diff"]
    return gradient_error(ref, results) < 1e-5 and diff < 1e-5 and all(r["skipped"] == 0 for r in results), diff


def measure(fault: str, deadline_s: float, timeout_s: float) -> dict:
    job = _job(fault, timeout_s)
    with tempfile.TemporaryDirectory() as marks:
        t0 = time.time()
        ranks = run_ranks(rank_run, job.world, fault, marks, timeout_s, timeout_s=deadline_s,
                          collective_timeout_s=GLOO_DEFAULT_TIMEOUT_S, raise_on_error=False)
        wall = time.time() - t0
        fault_at = float(open(os.path.join(marks, "fault")).read()) if os.path.exists(
            os.path.join(marks, "fault")) else None
    killed = {r for r, res in enumerate(ranks) if isinstance(res, tuple) and "exited with code" in res[1]}
    if fault in ("rank_stopped_mid_step", "rank_exits_zero"):
        killed.add(FAULTY)  # stopped then killed at the deadline, or left by itself: not a survivor
    survivors = [r for r in range(job.world) if r not in killed]
    hung = [r for r in survivors if isinstance(ranks[r], tuple) and "timed out" in ranks[r][1]]
    for r in survivors:  # a rank the watchdog ended reported its error itself, with the time
        if isinstance(ranks[r], tuple) and r not in hung:
            ranks[r] = {"error": ranks[r][1], "at": ranks[r][2] if len(ranks[r]) > 2 else t0 + wall}
    errors = {r: ranks[r]["error"] for r in survivors if isinstance(ranks[r], dict) and "error" in ranks[r]}
    row = {"bench": "faults", "fault": fault, "expected": EXPECTED.get(fault, "error"),
           "surviving_ranks": len(survivors), "deadline_s": deadline_s, "fault_timeout_s": timeout_s,
           "wall_s": round(wall, 1), "seconds_to_error": None,
           "ranks_with_message": sum(1 for m in errors.values() if re.search(rf"\brank {FAULTY}\b", m)),
           "cpp_trace": any("frame #" in m for m in errors.values())}
    if hung:
        row["outcome"] = "hang"
    elif len(errors) == len(survivors):
        row["outcome"] = "error"
        if fault_at is not None:
            row["seconds_to_error"] = round(max(ranks[r]["at"] for r in survivors) - fault_at, 2)
    elif not errors:
        ok, diff = _matches_one_process(fault, job, [ranks[r] for r in survivors])
        row["max_abs_param_diff_vs_one_process"] = diff
        row["outcome"] = ("skipped" if fault.endswith("_skip") else "correct") if ok else "silent"
    else:
        row["outcome"] = "error"  # some ranks only: the others' results say nothing
    row["messages"] = sorted({m.splitlines()[0][:400] for m in errors.values()})
    row["ended_without_result"] = {r: ranks[r][1][:200] for r in sorted(killed)}  # how a rank that reported nothing ended
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--fault", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds a run gets before it counts as a hang")
    ap.add_argument("--fault-timeout", type=float, default=30.0, help="gradsched's fault_timeout_s (its default)")
    ap.add_argument("--out", default=str(RESULTS / "faults.jsonl"), help="results file ('' for none)")
    args = ap.parse_args(argv)
    for i, fault in enumerate(args.fault):
        emit([measure(fault, args.deadline, args.fault_timeout)], args.out, append=i > 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
