"""Per-rank bodies of tests/test_misbehaving_ranks.py: one rank misbehaves, the others must name it."""
import time

import torch

import gradsched
from gradsched.sync.watchdog import JOURNAL
from tied_training import Job, batch, build_model, optimizer_class, optimizer_kwargs, reduced_gradients
from tiny_gpt import lm_loss

TIMEOUT_S = 3.0  # fault_timeout_s in these tests


def _dp2(job: Job):
    model, _ = build_model(job)
    model = gradsched.parallelize(model, plan=gradsched.ParallelPlan.from_world(pp=1, dp=2), loss_fn=lm_loss,
                                  **job.options)
    return model, gradsched.DistributedOptimizer(model, optimizer_class(job), **optimizer_kwargs(job))


def stuck_rank(rank, world, where: str):
    """pp1 x dp2: rank 1 loops forever in Python between its second train_step and opt.step ("python"), or is
    late by twice the fault timeout inside the optimizer's all-gather ("late")."""
    import gradsched.training.optimizer as optimizer
    job = Job(pp=1, dp=2, steps=2, options={"compiler": "eager", "fault_timeout_s": TIMEOUT_S})
    model, opt = _dp2(job)
    if rank == 1 and where == "late":
        gather = optimizer._all_gather

        def late(out, x, group):
            time.sleep(2 * TIMEOUT_S + 5)
            return gather(out, x, group)
        optimizer._all_gather = late
    for step in range(job.steps):
        x, y = batch(job, step)
        model.train_step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        if rank == 1 and where == "python" and step == 1:
            while True:  # the user's code, stuck
                pass
        opt.step()
        opt.zero_grad()
    opt.finish_param_gather()  # where a next step's forward would wait for the gather step() issued
    return "finished"


def patient_peers(rank, world):
    """pp1 x dp2: rank 1 is late by half the fault timeout in the optimizer's all-gather, then spends the
    fault timeout and a half inside a journal entry of kind "compile" (as while compiling) before its next collective.
    Neither is a fault. Returns the first step's reduced gradients and the parameters after 2 steps."""
    import gradsched.training.optimizer as optimizer
    job = Job(pp=1, dp=2, steps=2, options={"compiler": "eager", "fault_timeout_s": TIMEOUT_S})
    model, opt = _dp2(job)
    if rank == 1:
        gather, calls = optimizer._all_gather, []

        def late(out, x, group):
            if not calls:
                calls.append(1)
                time.sleep(TIMEOUT_S / 2)
            return gather(out, x, group)
        optimizer._all_gather = late
    grads = None
    for step in range(job.steps):
        x, y = batch(job, step)
        model.train_step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        if step == 0:
            grads = reduced_gradients(model.grad_sync)
        if rank == 1 and step == 1:
            with JOURNAL.entry("compiling (a stand-in)", "compile"):
                time.sleep(TIMEOUT_S + 1.5)
        opt.step()
        opt.zero_grad()
    sync = model.grad_sync
    return {"grads": grads, "params": {n: v.clone() for n, v in sync.full_parameters().items()}, "ties": [],
            "rank": rank, "stage": 0, "dp_idx": rank}


def _nan_in_the_first_activation_at_step(step_index: int):
    """Patch torch's PipelineStage (under gradsched's): at that step, one NaN in the first activation sent."""
    from torch.distributed.pipelining.stage import PipelineStage
    forward, state = PipelineStage.forward_one_chunk, {"calls": 0}

    def nan_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        state["calls"] += 1
        if state.get("armed"):
            state["armed"] = False
            with torch.no_grad():
                out.view(-1)[0] = float("nan")
        return out
    PipelineStage.forward_one_chunk = nan_forward
    return state


def _nan_received_by_stage_1(state: dict):
    """Patch torch's PipelineStage (under gradsched's): while state["armed"] is set, one NaN written into the
    activation stage 1 received for micro-batch 1, after its sender computed it finite (corruption in transit).
    Returns the undo."""
    from torch.distributed.pipelining.stage import PipelineStage
    retrieve = PipelineStage._retrieve_recv_activations

    def corrupted(self, fwd_chunk_id):
        out = retrieve(self, fwd_chunk_id)
        if state.get("armed") and fwd_chunk_id == 1:
            state["armed"] = False
            with torch.no_grad():
                out[0].view(-1)[0] = float("nan")
        return out
    PipelineStage._retrieve_recv_activations = corrupted
    return lambda: setattr(PipelineStage, "_retrieve_recv_activations", retrieve)


def pipeline_misbehaviour(rank, world):
    """pp2 x dp1, four jobs in one set of processes (each ends on both ranks together):
    "shape": rank 0's first batch is 4 tokens shorter (refused at setup, rank 0 named as the sender);
    "raise": rank 0 (stage 0) sends one NaN at step 2 (NonFiniteError on both);
    "skip": the same with on_nonfinite="skip" (both skip step 2);
    "unlabelled": step 2's targets are all ignore_index (its mean loss is NaN: NonFiniteError on both);
    "transit": a NaN written into what rank 1 received at step 2, its sender's output finite.
    Returns {job: the error text, or the skipped steps and parameters}."""
    out = {}
    state = _nan_in_the_first_activation_at_step(1) if rank == 0 else {}
    for name in ("shape", "raise", "skip", "unlabelled", "transit"):
        torch._dynamo.reset()
        options = {"compiler": "eager", "fault_timeout_s": 30.0}
        if name == "skip":
            options["on_nonfinite"] = "skip"
        if name == "transit":
            options["microbatches"] = 2  # micro-batch 1 is corrupted
        job = Job(pp=2, dp=1, steps=3, options=options)
        model, split_points = build_model(job)
        model = gradsched.parallelize(model, plan=gradsched.ParallelPlan.from_world(pp=2, dp=1), loss_fn=lm_loss,
                                      split_points=split_points, **options)
        opt = gradsched.DistributedOptimizer(model, optimizer_class(job), **optimizer_kwargs(job))
        transit = {}
        undo = _nan_received_by_stage_1(transit) if name == "transit" and rank == 1 else (lambda: None)
        try:
            for step in range(job.steps):
                x, y = batch(job, step)
                transit["armed"] = step == 1
                if name == "shape" and rank == 0:
                    x, y = x[:, :-4], y[:, :-4]
                if name == "unlabelled" and step == 1:
                    y = torch.full_like(y, -100)
                state["armed"] = name in ("raise", "skip") and step == 1
                model.train_step(x, y)
                opt.step()
                opt.zero_grad()
            sync = model.grad_sync
            out[name] = {"skipped": opt.skipped_steps, "rank": rank, "stage": rank, "dp_idx": 0,
                         "params": {n: v.clone() for n, v in sync.full_parameters().items()},
                         "ties": [t.members for t in sync.ties.values()]}
        except Exception as e:  # noqa: BLE001 - what each rank says is the test's subject
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            undo()
    for shard in (False, True):  # then pp1 x dp2 on the same processes
        out[f"grads shard={shard}"] = _nan_in_one_ranks_gradients(rank, shard)
    out["grads shard=True fp16"] = _nan_in_one_ranks_gradients(rank, True, torch.float16)
    for on in ("raise", "skip"):  # shard=False with the user's own torch optimizer over the parameters
        out[f"grads plain {on}"] = _nan_in_one_ranks_gradients(rank, False, plain=on)
    out["by name plain raise"] = _nan_loss_under_the_backend_by_name(rank)
    return out


def _nan_loss_under_the_backend_by_name(rank) -> str | None:
    """pp1 x dp2 compiled by backend name (shard=False) with a plain torch SGD: rank 1's loss is NaN at step 2.
    Returns the error each rank says (None: the steps ran)."""
    torch._dynamo.reset()
    job = Job(pp=1, dp=2, steps=3)
    model, _ = build_model(job)
    compiled = torch.compile(model, backend="gradsched", options={
        "plan": gradsched.ParallelPlan.from_world(pp=1, dp=2), "shard": False, "compiler": "eager",
        "fault_timeout_s": 30.0})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(job.steps):
            x, y = (t.chunk(2)[rank] for t in batch(job, step))
            loss = lm_loss(compiled(x), y)
            (loss * float("nan") if step == 1 and rank == 1 else loss).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - what each rank says is the test's subject
        return f"{type(e).__name__}: {e}"
    return None


def loss_with_nan_gradient_where_first_target_unlabelled(logits, targets):
    """lm_loss, whose gradient (not its value) is NaN when a sequence's first target is ignore_index: 0 * sqrt(0)
    is 0, its derivative 0 * inf."""
    zero = logits.sum() * 0 + (targets[:, 0] != -100).all().to(logits.dtype)  # 0 when so, else 1
    return lm_loss(logits, targets) + 0 * zero.sqrt()


def _nan_in_one_ranks_gradients(rank, shard, reduce_dtype=None, plain="") -> dict:
    """pp1 x dp2: at step 2 rank 1's gradients go NaN, its loss finite. Returns the error each rank says and
    whether the step's row gather was issued before the last backward (each rank's reduced-gradient flag is every
    rank's, so no rank needs another's: nonfinite.reduced_alike). plain: a torch optimizer over
    model.parameters() (shard=False) instead of DistributedOptimizer, under on_nonfinite=plain; then also the
    parameters after the steps."""
    torch._dynamo.reset()
    job = Job(pp=1, dp=2, steps=3, options={"compiler": "eager", "shard": shard, "microbatches": 2, "fault_timeout_s": 30.0,
                                            **({"reduce_dtype": reduce_dtype} if reduce_dtype else {}),
                                            **({"on_nonfinite": plain} if plain else {})})
    model, _ = build_model(job)
    model = gradsched.parallelize(model, plan=gradsched.ParallelPlan.from_world(pp=1, dp=2),
                                  loss_fn=loss_with_nan_gradient_where_first_target_unlabelled, **job.options)
    if plain:  # two, as a user may step an embedding's parameters apart from the rest's: they share one verdict
        params = list(model.parameters())
        opts = [optimizer_class(job)(ps, **optimizer_kwargs(job)) for ps in (params[:1], params[1:])]
    else:
        opts = [gradsched.DistributedOptimizer(model, optimizer_class(job), **optimizer_kwargs(job))]
    out, first = {"early": False, "error": None}, JOURNAL.count  # this run's entries: those numbered after
    try:
        for step in range(job.steps):
            x, y = (t.chunk(2)[rank] for t in batch(job, step))
            if step == 1 and rank == 1:
                y = y.clone()
                y[0, 0] = -100
            model.train_step(x, y)
            out["early"] |= any("issued before the last backward" in e.what for e in JOURNAL.entries if e.seq > first)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        # gathers of the flags beside the step's own (one an optimizer asking again would add)
        out["flag_gathers"] = sum(e.seq > first and e.what == "the step's non-finite flags" for e in JOURNAL.entries)
        out.update(rank=rank, stage=0, dp_idx=rank, ties=[t.members for t in model.grad_sync.ties.values()],
                   skipped=model.skipped_steps,
                   params={n: v.clone() for n, v in model.grad_sync.full_parameters().items()})
    except Exception as e:  # noqa: BLE001 - what each rank says is the test's subject
        out["error"] = f"{type(e).__name__}: {e}"
    return out
