"""Per-rank bodies for tests/test_replicas.py: replicas built unlike each other (spawned processes import this)."""
import zlib
from dataclasses import replace

import torch

import gradsched
import tied_training
import rank_fns
from tied_training import Job, optimizer_class, optimizer_kwargs
from tiny_gpt import GPTConfig, TinyGPT, lm_loss, make_batch


def trained_with_odd_replicas(rank, world, job: Job, odd_ranks, odd: dict) -> dict:
    """tied_training.rank_main, the ranks in `odd_ranks` building their model from `replace(job, **odd)` (another
    seed, another config) while training on the job's own batches."""
    build = tied_training.build_model
    tied_training.build_model = lambda j: build(replace(j, **odd) if rank in odd_ranks else j)
    try:
        return tied_training.rank_main(rank, world, job)
    finally:
        tied_training.build_model = build


def by_backend_name(rank, world, job: Job, odd_ranks, odd_seed: int) -> dict:
    """Data parallel through torch.compile(backend="gradsched") alone; the ranks in `odd_ranks` build the model
    from `odd_seed`. The first step's reduced gradients and the trained parameters."""
    plan = gradsched.ParallelPlan.from_world(pp=1)
    torch.manual_seed(odd_seed if rank in odd_ranks else job.seed)
    model = TinyGPT(job.config)
    compiled = torch.compile(model, backend="gradsched", fullgraph=True, options={"plan": plan, **job.options})
    opt = gradsched.DistributedOptimizer(compiled, optimizer_class(job), **optimizer_kwargs(job))
    return rank_fns.train_by_backend_name(rank, world, job, model, compiled, opt)


def init_from_another_seed(name: str, t: torch.Tensor) -> None:
    """rank_fns.init_tiny_gpt drawing from another seed (gradsched seeds torch's RNG per name before the call)."""
    torch.manual_seed(7 + zlib.crc32(name.encode()))
    rank_fns.init_tiny_gpt(name, t)


def meta_built_with_odd_init(rank, world, pp: int, odd_ranks, steps: int) -> dict:
    """rank_fns.meta_built_training, the ranks in `odd_ranks` initializing with init_from_another_seed."""
    build = rank_fns.build_on_meta

    def built(model_name):
        model, split_points, init = build(model_name)
        return model, split_points, init_from_another_seed if rank in odd_ranks else init
    rank_fns.build_on_meta = built
    try:
        return rank_fns.meta_built_training(rank, world, pp, {}, steps)
    finally:
        rank_fns.build_on_meta = build


class Mixed(torch.nn.Module):
    """Parameters and buffers of several dtypes, a tie, a non-contiguous parameter and a frozen one."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.t = torch.nn.Parameter(torch.randn(4, 2).t())  # not contiguous
        self.low = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("count", torch.randint(0, 100, (3,)))
        self.register_buffer("mask", torch.rand(6) > 0.5)


def mixed_tensors(rank, world, pp: int) -> dict:
    """make_replicas_equal on a Mixed module whose values depend on the rank: the values after, and the
    collectives it issued (from the journal)."""
    from gradsched.sync.replicas import make_replicas_equal
    from gradsched.sync.watchdog import JOURNAL
    plan = gradsched.ParallelPlan.from_world(pp=pp)
    torch.manual_seed(rank)
    m = Mixed()
    before = len(JOURNAL.entries)
    make_replicas_equal(m, plan)
    return {"stage": plan.stage, "state": {k: v.clone() for k, v in m.state_dict().items()},
            "tied": m.a.weight is m.b.weight, "t_strides": m.t.stride(),
            "collectives": [(e.op, e.numel, e.dtype, len(e.group)) for e in JOURNAL.entries[before:]]}


def cases(rank, world, runs: list) -> list:
    """Several runs in one set of processes: (function name, args) each; a run's result, or ("error", text).
    A ReplicaMismatch is raised by every rank at the same point, so the next run can start; after any other
    error the rest are skipped (the other ranks may be waiting in a collective of it)."""
    out = []
    for name, args in runs:
        torch._dynamo.reset()
        try:
            out.append(globals()[name](rank, world, *args))
        except Exception as e:  # noqa: BLE001 - the test reads it
            out.append(("error", f"{type(e).__name__}: {e}"))
            if type(e).__name__ != "ReplicaMismatch":
                out += [("error", "not run: an earlier run failed on this rank")] * (len(runs) - len(out))
                break
    return out


def one_process_meta(steps: int) -> dict:
    """The reference of meta_built_training: the whole model initialized by name in one process, SGD 0.5."""
    from gradsched.training.materialize import first_names, initialize
    model = TinyGPT()
    initialize(model, rank_fns.init_tiny_gpt, first_names(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        x, y = make_batch(8, model.config, seed=1 + step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


__all__ = ["GPTConfig", "cases", "one_process_meta"]
