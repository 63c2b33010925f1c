"""Train the tiny tied GPT under a plan and against its single-process reference.

Shared by the demo, the tests and the tied_grad_sync benchmark, so the three
measure the same thing. The reference is the same model, unsplit, in one
process, on the whole global batch, with the same optimizer.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .tiny_gpt import GPTConfig, TinyGPT, lm_loss, make_batch


@dataclass
class Job:
    pp: int = 2
    dp: int = 2
    cp: int = 1
    steps: int = 3
    global_batch: int = 8
    lr: float = 1e-3  # a small GPT's usual rate; Adam scales rounding noise of near-zero gradients by lr
    seed: int = 0
    config: GPTConfig = field(default_factory=GPTConfig)
    model: str = "tiny_gpt"  # or a name in gradsched.hf.MODELS (Hugging Face)
    dtype: str = "float32"  # the parallel run's parameter dtype; the reference is always fp32
    data_batches: int = 0  # 0: a fresh random batch each step; k: cycle over k fixed batches
    split_points: tuple = ("blocks.1",)
    schedule: str = "auto"
    options: dict = field(default_factory=lambda: {"compiler": "eager"})

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp
    rank_options: dict = field(default_factory=dict)  # rank -> options overriding `options` there
    ties: list | None = None  # explicit tie declaration (override); None: discover
    capture_code: bool = False  # return the code Inductor generates during the first step


def batch(job: Job, step: int):
    k = step % job.data_batches if job.data_batches else step
    return make_batch(job.global_batch, job.config, seed=job.seed + 1 + k)


def build_model(job: Job):
    """(model, split points) with the job's seed: the same weights in every process."""
    torch.manual_seed(job.seed)
    if job.model == "tiny_gpt":
        return TinyGPT(job.config), list(job.split_points)
    from .hf import MODELS
    c = job.config
    return MODELS[job.model](vocab=c.vocab, seq=c.seq, dim=c.dim, layers=c.layers, heads=c.heads)


def optimizer_kwargs(job: Job) -> dict:
    return {"lr": job.lr, "weight_decay": 0.1}


def reference(job: Job) -> dict:
    """Unsplit model, one process: losses per step and every parameter by every name it has."""
    model, _ = build_model(job)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(job))
    losses = []
    for step in range(job.steps):
        x, y = batch(job, step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    from .ties import shared_parameters
    return {"losses": losses, "params": params, "aliases": shared_parameters(model)}


def rank_main(rank: int, world: int, job: Job) -> dict:
    """One rank of the parallel run; returns what it ends with (see keys)."""
    import gradsched

    plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp, cp=job.cp)
    opts = {**job.options, **job.rank_options.get(rank, {})}
    model, split_points = build_model(job)
    model = gradsched.parallelize(model.to(getattr(torch, job.dtype)), plan=plan, loss_fn=lm_loss,
                                  split_points=split_points if job.pp > 1 else (), schedule=job.schedule, ties=job.ties,
                                  **opts)
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, **optimizer_kwargs(job))
    _, dp_idx, cp_idx = plan.coords()
    per_rank = job.global_batch // job.dp
    losses, times, code = [], [], []
    for step in range(job.steps):
        x, y = batch(job, step)
        sl = slice(dp_idx * per_rank, (dp_idx + 1) * per_rank)
        t0 = time.perf_counter()
        if job.capture_code and step == 0:
            from torch._inductor.utils import run_and_get_code
            loss, code = run_and_get_code(model.train_step, x[sl], y[sl])
        else:
            loss = model.train_step(x[sl], y[sl])
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(None if loss is None else float(loss))
    sync = model.grad_sync
    return {
        "rank": rank, "stage": plan.stage, "dp_idx": dp_idx, "cp_idx": cp_idx,
        "losses": losses, "step_times": times,
        "params": {n: p.detach().clone() for n, p in sync.state.params.items()},
        "ties": [t.members for t in sync.ties.values()],
        "tied_buckets": [sync.layout.locate(name)[0].index for name in sync.ties],
        "n_buckets": len(sync.layout.buckets),
        "report": sync.schedule_report(),
        "verifier": "ok" if sync.state.verdict is None or sync.state.verdict.ok else "hazard",
        "verdict": str(sync.state.verdict),
        "tied_bytes_per_step": sync.tied_bytes_per_step(),
        "within_module_ties": model.within_module_ties,
        "sync_runs": sync.sync_runs, "backward_calls": sync.backward_calls,
        "code": code,
        "sync_graph_ops": [str(n.target) for n in sync.state.sync_gm.graph.nodes if n.op == "call_function"],
    }


def compare(ref: dict, ranks: list[dict]) -> dict:
    """Max |parallel - reference| over every parameter of every rank, and tied-copy equality."""
    worst, missing = 0.0, []
    for r in ranks:
        for name, p in r["params"].items():
            if name not in ref["params"]:
                missing.append(name)
                continue
            worst = max(worst, (p - ref["params"][name]).abs().max().item())
    # tied copies: every stage's copy of one weight, on the same dp index, bitwise equal
    tied_equal = True
    for r in ranks:
        for members in r["ties"]:
            for other in ranks:
                same_slot = (other["dp_idx"], other.get("cp_idx", 0)) == (r["dp_idx"], r.get("cp_idx", 0))
                if same_slot and other["stage"] != r["stage"]:
                    mine = dict(members).get(r["stage"])
                    theirs = dict(members).get(other["stage"])
                    if mine and theirs:
                        tied_equal &= torch.equal(r["params"][mine], other["params"][theirs])
    covered = {n for r in ranks for n in r["params"]}
    aliased = {n for group in ref["aliases"] if covered & set(group) for n in group}
    return {"max_abs_diff": worst, "tied_bitwise_equal": tied_equal, "missing": missing,
            "uncovered": sorted(set(ref["params"]) - covered - aliased)}


def job_dict(job: Job) -> dict:
    d = asdict(job)
    d["config"] = asdict(job.config)
    return d
