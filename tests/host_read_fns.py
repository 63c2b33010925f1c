"""Per-rank body of tests/test_host_reads.py: record every host read of a tensor's value during steady steps."""
import torch

import gradsched
from gradsched.training import host_reads
from tied_training import Job, batch, build_model
from tiny_gpt import lm_loss

STEPS, RECORDED = 5, range(2, 5)  # steps 3 to 5: after warm-up (compiles, first runs, pipelining's shape inference)
# (dp, cp, shard) on 4 ranks at pp2, one set of processes: CP off and on, shard=True and "params" (each
# Inductor compile of a pipeline costs about a minute here: two configurations cover the four)
CONFIGS = {"pp2_dp2_shard_true": (2, 1, True), "pp2_cp2_shard_params": (1, 2, "params")}


def one_step(model, opt, job: Job, step: int, dp_idx: int) -> None:
    x, y = batch(job, step)
    per_rank = job.global_batch // job.dp
    sl = slice(dp_idx * per_rank, (dp_idx + 1) * per_rank)
    model.train_step(x[sl], y[sl])
    opt.step()
    opt.zero_grad()


def steady_steps(dp: int, cp: int, shard, inject: bool) -> dict:
    """4 micro-batches, Inductor: the unexpected reads of steps 3 to 5, as text (each with its stack); with
    inject, those of a sixth step in which gradsched's label count reads one value with .item()."""
    torch._dynamo.reset()
    job = Job(pp=2, dp=dp, cp=cp, steps=STEPS)
    plan = gradsched.ParallelPlan.from_world(pp=2, dp=dp, cp=cp)
    model, split_points = build_model(job)
    model = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, split_points=split_points, microbatches=4,
                                  compiler="inductor", shard=shard)
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    _, dp_idx, _ = plan.coords()
    reads = []
    for step in range(STEPS):
        if step in RECORDED:
            with host_reads.recording() as seen:
                one_step(model, opt, job, step, dp_idx)
            reads += [r.text() for r in seen.unexpected()]
        else:
            one_step(model, opt, job, step, dp_idx)
    injected = None
    if inject:  # the test must see one added .item() inside a step, with its stack
        from gradsched.training import loss_weights
        labelled = loss_weights.labelled

        def reading(target, ignore_index):
            n = labelled(target, ignore_index)
            n.item()  # the injected read
            return n
        loss_weights.labelled = reading
        try:
            with host_reads.recording() as seen:
                one_step(model, opt, job, STEPS, dp_idx)
        finally:
            loss_weights.labelled = labelled
        injected = [r.text() for r in seen.unexpected()]
    return {"stage": plan.stage, "reads": reads, "injected": injected}


def steady_steps_reads(rank, world, names: list):
    return {name: steady_steps(*CONFIGS[name], inject=name == "pp2_dp2_shard_true") for name in names}
