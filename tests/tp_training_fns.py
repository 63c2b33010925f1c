"""Per-rank bodies of tests/test_tp_training.py: gradsched.parallelize over tp (x dp) trains the model one
process trains, in float64. Each job's reference is the unsplit model in this process, on the global batch."""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

import gradsched
from gradsched.passes.tp_layouts import take_chunk
from tied_training import abs_diff, pad_labels, reduced_gradients
from tiny_gpt import GPTConfig, make_batch
from tp_fns import SEQ, build, in_graph_loss
from gradsched.tp.replica_check import ReplicasDiverged


@dataclass(frozen=True)
class Job:
    model: str = "tiny_gpt"
    compiler: str = "eager"
    tp: int = 2
    dp: int = 1
    pp: int = 1
    cp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    split: tuple = ()  # the pipeline's split points (module names), under pp > 1
    shard: object = False
    steps: int = 2
    clip: float = 0.0
    options: dict = field(default_factory=dict)
    global_batch: int = 4
    perturb: str = ""  # a TP-replicated parameter TP rank 1 nudges before the last step (check_tp_replicas)
    labels: str = "full"  # "padded": tied_training's right padding (a micro-batch of a dp rank labels nothing)


class Logits(nn.Module):
    """A model whose forward returns its logits (a Hugging Face model returns an output object)."""

    def __init__(self, model, forward):
        super().__init__()
        self.model, self._forward = model, forward

    def forward(self, tokens, positions=None):  # positions: each CP rank's own (non-contiguous) ones
        return self._forward(self.model, tokens, positions)


def model_of(job: Job) -> nn.Module:
    return Logits(*build(job.model, torch.float64))


def batch(job: Job, step: int):
    x, y = make_batch(job.global_batch, GPTConfig(seq=SEQ), seed=10 + step)
    if job.labels == "padded":
        y = pad_labels(y, step)
    return x, y


def reference(job: Job, compiled: bool = False) -> dict:
    """The job in one process, eager (or, compiled=True, under torch.compile(backend="inductor")): losses, the
    first step's gradients and the parameters after the last step."""
    model = model_of(job)
    forward = torch.compile(model, backend="inductor") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads, norms = [], None, []
    for step in range(job.steps):
        x, y = batch(job, step)
        loss = in_graph_loss(forward(x), y)
        loss.backward()
        # every name a parameter has: a stage's copy of a tie is compared with the one Parameter's gradient
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        if job.clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def rank_main(rank: int, world: int, job: Job) -> dict:
    plan = gradsched.ParallelPlan.from_world(tp=job.tp, dp=job.dp, pp=job.pp, cp=job.cp)
    pipeline = dict(split_points=job.split, schedule=job.schedule) if job.pp > 1 else {}
    model = gradsched.parallelize(model_of(job), plan=plan, loss_fn=in_graph_loss, compiler=job.compiler,
                                  shard=job.shard, microbatches=job.microbatches, **pipeline, **job.options)
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.SGD(model.parameters(), lr=0.0)  # built before the shards are cut: refused at its step
    plain_refused = None
    dp_idx, per_rank = plan.index("dp"), job.global_batch // job.dp
    losses, grads, norms = [], None, []
    for step in range(job.steps):
        x, y = batch(job, step)
        sl = slice(dp_idx * per_rank, (dp_idx + 1) * per_rank)
        loss = model.train_step(x[sl], y[sl])
        losses.append(None if loss is None else float(loss))  # None on a stage before the last
        grads = grads or reduced_gradients(model.grad_sync)
        if step == 0:
            try:
                plain.step()
            except RuntimeError as e:
                plain_refused = str(e)
        if job.clip:
            norms.append(gradsched.clip_grad_norm_(model, job.clip).item())
        if job.perturb and step == job.steps - 1 and plan.index("tp") == 1:
            with torch.no_grad():
                dict(model.named_parameters())[job.perturb].view(-1)[0] += 1e-9
        try:
            opt.step()
        except ReplicasDiverged as e:
            return {"diverged": str(e)}
        opt.zero_grad()
    shards = model.model_state.tp_shards
    # the module whose parameters the rank trains: the model, or under pp > 1 its stage
    whole = dict(model.model_state.trained_module().named_parameters())
    partitions = {n: (p.dim, p.segments) for n, w in whole.items()
                  if shards is not None and (p := shards.partition_of(w)) is not None}
    built = model.grad_sync.built
    return {"plain_refused": plain_refused, "losses": losses, "stage": plan.stage, "grads": grads, "norms": norms, "tp_idx": plan.index("tp"), "partitions": partitions,
            "state": model.state_dict(), "proved": built.tp_proof.proved if built.tp_proof else None,
            "held_bytes": sum(p.untyped_storage().nbytes() for p in whole.values()),
            # what a rank would hold of whole parameters: the replicated ones it trains, by shape (none under
            # "params"; never a tied copy the pipeline's split left on a stage that does not read it)
            "replicated_bytes": 0 if job.shard == "params" else sum(
                w.numel() * w.element_size() for n, w in whole.items()
                if partitions.get(n, (None,))[0] is None and n not in model.model_state.stale_names()),
            "whole_numel": sum(w.numel() for w in whole.values()),
            # cp > 1: each attention call the ring (or Ulysses) took: (its scheme, this rank's query and KV heads)
            "lowered": [(a.comm, a.q_heads, a.kv_heads) for rep in model.grad_sync.attention_reports for a in rep.lowered],
            "names": [n for n, _ in model.named_parameters()],
            "ties": [list(t.members) for t in model.ties],  # (stage, that stage's name) of each tie's copies
            # this rank's own copies of them, as it trains them (TP shards gathered: equal whole, equal shards)
            "tied_state": {n: v for n, v in model.model_state.local_state().items()
                           if (plan.stage, n) in {m for t in model.ties for m in t.members}},
            "dp_idx": plan.index("dp"), "cp_idx": plan.index("cp"),
            # pp > 1: the local logits' shape of each loss run loss-parallel after the last stage (none: gathered)
            "loss_logits": list(loss.shapes) if (loss := model.global_loss.vocab_parallel) is not None else None,
            "vocab": sorted({w.shape[p.dim] for w in whole.values()
                             if shards is not None and (p := shards.partition_of(w)) is not None and p.role == "vocab"}),
            "trained_numel": sum(p.numel() for _, p in model.named_parameters())}


def training_jobs(rank: int, world: int, jobs: list) -> list:
    """Every job on one set of processes, each from a fresh Dynamo."""
    out = []
    for job in jobs:
        torch._dynamo.reset()
        out.append(rank_main(rank, world, job))
    return out


def reference_distance(a: dict, b: dict) -> dict:
    """How far two one-process runs of a job are apart: losses, step-1 gradients, parameters, clipping norms."""
    worst = lambda pairs: max((abs_diff(x, y) for x, y in pairs), default=0.0)  # noqa: E731
    number = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731  (a float32 tensor would round both alike)
    return {"losses": worst(zip(map(number, a["losses"]), map(number, b["losses"]))),
            "grads": worst((a["grads"][k], b["grads"][k]) for k in a["grads"]),
            "state": worst((a["state"][k], b["state"][k]) for k in a["state"]),
            "norms": worst(zip(map(number, a["norms"]), map(number, b["norms"])))}


def expected_grad(ref: dict, r: dict, name: str, tp: int) -> torch.Tensor:
    """The reference gradient of `name` as rank r holds it: its TP chunk when sharded."""
    g = ref["grads"][name]
    if name in r["partitions"]:
        dim, segments = r["partitions"][name]
        g = take_chunk(g, dim, segments, tp, r["tp_idx"])
    return g


def gradient_error(ref: dict, ranks: list, tp: int) -> float:
    """Max |a rank's reduced gradient - the reference's (its TP chunk)| over every rank and parameter; inf on a
    NaN, a missing gradient or a name the rank trains that the reference does not have."""
    worst = 0.0
    for r in ranks:
        got = r["grads"]
        if "full" in got:
            for name, g in got["full"].items():
                worst = max(worst, abs_diff(g, expected_grad(ref, r, name, tp)) if name in ref["grads"] else math.inf)
            continue
        for shard, (numel, slots) in zip(got["shards"], got["buckets"]):
            flat = torch.full((numel,), math.nan, dtype=torch.float64)  # padding is compared to nothing
            for name, offset, n in slots:
                flat[offset:offset + n] = expected_grad(ref, r, name, tp).reshape(-1)
            size = numel // got["shards_n"]
            want = flat[got["shard_index"] * size:(got["shard_index"] + 1) * size]
            held = ~torch.isnan(want)
            worst = max(worst, abs_diff(shard[held], want[held]))
    return worst


def resume_main(rank: int, world: int, job: Job, save_to: str, load_from: str, stop: int) -> dict:
    """`job`'s layout trains from the start, or from the checkpoint at `load_from`, up to step `stop`, then saves
    to `save_to` ('' : no save). Returns the steps' losses and the state dict after them (TP shards gathered)."""
    plan = gradsched.ParallelPlan.from_world(tp=job.tp, dp=job.dp, pp=job.pp, cp=job.cp)
    pipeline = dict(split_points=job.split, schedule=job.schedule, microbatches=job.microbatches) if job.pp > 1 else {}
    model = gradsched.parallelize(model_of(job), plan=plan, loss_fn=in_graph_loss, compiler=job.compiler,
                                  shard=job.shard, **pipeline, **job.options)
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    start = gradsched.load(load_from, model, opt)["step"] if load_from else 0
    dp_idx, per_rank, losses = plan.index("dp"), job.global_batch // job.dp, []
    for step in range(start, stop):
        x, y = batch(job, step)
        sl = slice(dp_idx * per_rank, (dp_idx + 1) * per_rank)
        loss = model.train_step(x[sl], y[sl])
        losses.append(None if loss is None else float(loss))
        opt.step()
        opt.zero_grad()
    if save_to:
        gradsched.save(save_to, model, opt, step=stop)
    return {"start": start, "losses": losses, "state": model.state_dict()}


class SequenceCentered(nn.Module):
    """`inner` of each token less the sequence's mean: a reduction over the sequence, which no TP rank can compute
    on its chunk of it (sequence parallelism), so the tensor-parallel pass refuses it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x - x.mean(1, keepdim=True))


def refused_in_the_last_stage(rank: int, world: int) -> str:
    """tp2 x pp2 with the sequence-mixing op in the last stage only: what each rank's train_step raises."""
    model = model_of(Job())
    model.model.ln_f = SequenceCentered(model.model.ln_f)
    plan = gradsched.ParallelPlan.from_world(tp=2, pp=2)
    model = gradsched.parallelize(model, plan=plan, loss_fn=in_graph_loss, split_points=["model.blocks.1"],
                                  microbatches=2)
    x, y = batch(Job(), 0)
    try:
        model.train_step(x, y)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "trained"
