"""What the dry run (gradsched.dryrun) runs for one pipeline rank: its role's record, the fake world it plays in, its
stages' inputs as the split wires them, and its forwards and backwards in the order torch's schedule runs them on
that rank (one stage a rank: `run_schedule`; several: `run_rank_schedule`, from torch's own action list)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from gradsched.training.pipeline_schedule import CUT_BACKWARD, rank_actions, schedule_order


@dataclass
class Role:
    """One pipeline stage's ranks, as one of them measured them."""
    stage: int
    ranks: str
    params: int = 0  # bytes: the parameters (their shards under shard="params")
    grads: int = 0  # the reduced gradient shards and any whole .grad held when the optimizer steps
    masters: int = 0  # fp32 master copies that are not the parameters' shards themselves
    optimizer: int = 0  # optimizer state
    peak: int = 0  # held at the step's start + the highest sum of what its ops created
    held: int = 0  # of which: held at the third step's start
    transient: int = 0  # of which: the most the step's ops held at once above that
    saved: int = 0  # what they held after the first micro-batch's forward (its saved activations, its output)
    # a backward's peak above the saved activations of the micro-batches in flight at its start (saved each):
    accumulating: int = 0  # the most of any but the last (m > 1: the gradients accumulated so far, and the new)
    final_backward: int = 0  # the last's (its reductions; with m > 1 fed the accumulated gradients; under zb1p
    #                          the last B's: its reductions run in the last W, counted in the transient only)
    stash: int = 0  # under zb1p, the most a B left alive for its W (what it added, plus the saved it consumed)
    stages: list = field(default_factory=list)  # several stages a rank: the rank's (its role is the rank's)
    collectives: dict = field(default_factory=dict)  # "op over group kind" -> bytes per step
    p2p: dict = field(default_factory=dict)  # "activations received" / "their gradients sent back" -> bytes per step
    buckets: list = field(default_factory=list)  # elements of each bucket (padded), in reduction order
    verdict: str = ""
    seconds: float = 0.0


def fake_world(rank: int, world: int) -> None:
    """This process plays `rank` of `world` on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def stage_args(pipe, stage: int, sent: list, i: int) -> tuple:
    """Micro-batch i's inputs of `stage`, from the earlier stages' outputs as the split wires them (a value
    may come from any earlier stage, not only the previous one: pipelining sends it there directly)."""
    import operator
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]  # one per stage, in stage order
    call = calls[stage]

    def source(a):
        index = 0
        if a.op == "call_function" and a.target is operator.getitem:
            a, index = a.args
        return sent[calls.index(a)][i][index]
    return tuple(source(a) for a in call.args)


def like(shape, dtype, device, requires_grad):
    """What a later stage receives: a fresh tensor of an output's shape; torch's pipeline stage asks for a
    gradient of each floating-point one the model computed with one (not, e.g., rotary embeddings computed
    under no_grad)."""
    return torch.empty(shape, dtype=dtype, device=device).requires_grad_(dtype.is_floating_point and requires_grad)


def nbytes(shape, dtype, device, requires_grad) -> int:
    return shape.numel() * dtype.itemsize


def run_schedule(pm, inputs, targets, stage: int, pp: int, m: int, live):
    """The stage's micro-batches in its schedule's order; returns each forward's outputs (leaves) as
    (shape, dtype, device, requires_grad), what `live` counted after the first forward, and each backward's
    peak above that many bytes per micro-batch in flight at its start (see Role.accumulating), and the most a B
    left alive for its W (Role.stash)."""
    outs, pending, saved, above, weights, stash = [None] * m, {}, None, [], {}, 0
    last, split = stage == pp - 1, pm.schedule_name in CUT_BACKWARD
    if pp > 1:
        pm.grad_sync.begin_step()
    for kind, i in schedule_order(stage, pp, m, pm.schedule_name):
        if kind == "W":  # the weights' gradients of micro-batch i, queued by its B (its stash held until now)
            weights.pop(i)()
            continue
        if kind == "F":
            out = pm.module(*inputs[i])
            leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            # only their shapes are kept: a stage's outputs die after its backward (a last stage's with its loss)
            outs[i] = [(t.shape, t.dtype, t.device, t.requires_grad) for t in leaves]
            pending[i] = pm.loss_fn(out, targets[i]) if last else leaves
            del out, leaves
            saved = live.now if saved is None else saved
            continue
        peak, in_flight, live.peak, before = live.peak, len(pending), live.now, live.now  # its own peak, then the step's
        with pm.grad_sync.step_boundary(last=i == m - 1):
            if last:
                pending.pop(i).backward()
            else:
                grads = [t for t in pending.pop(i) if t.requires_grad]
                torch.autograd.backward(grads, [torch.empty_like(t) for t in grads])
        if split:
            weights[i] = pm.grad_sync.take_w()
            stash = max(stash, live.now - before + saved)
        above.append(live.peak - in_flight * saved)
        live.peak = max(peak, live.peak)
    pm.grad_sync.flush()
    return outs, saved, above, stash


def stage_outputs(pipe, chunks: list, num_stages: int) -> list:
    """Several stages a rank: what every stage receives, before any rank runs (a V's rank 0 holds the last stage,
    which reads stage 2 pp - 2's outputs): each stage's outputs, from its module run on `like` inputs (meta), as
    `run_schedule`'s outputs feed later stages with one stage a rank."""
    sent = []
    for s in range(num_stages):
        ins = chunks[0] if s == 0 else stage_args(pipe, s, sent, 0)
        out = pipe.get_stage_module(s)(*ins)  # meta: nothing is computed, and requires_grad is the model's
        leaves = [like(t.shape, t.dtype, t.device, t.requires_grad) for t in tree_leaves(out)
                  if isinstance(t, torch.Tensor)]
        sent.append([leaves] * len(chunks))
    return sent


def run_rank_schedule(pm, inputs: dict, targets, rank: int, m: int, live):
    """`run_schedule` for a rank of several stages (`inputs`: stage -> its micro-batches' inputs), in torch's
    action order for the rank. Returns (stage -> each forward's outputs as (shape, dtype, device, requires_grad)),
    what `live` held after the rank's first forward, each backward's peak above the micro-batches in flight at its
    start, and the most a B left alive for its W."""
    compiled = {s: c for s, c, _ in pm.stages}
    last, split = pm.num_stages - 1, pm.schedule_name in CUT_BACKWARD
    outs, pending, weights = {s: [None] * m for s in compiled}, {}, {}
    saved, above, stash = None, [], 0
    pm.grad_sync.begin_step()
    for kind, s, i in rank_actions(pm.schedule_name, rank, pm.plan.pp, pm.stages_per_rank, m):
        if kind == "W":
            weights.pop((s, i))()
            continue
        if kind == "F":
            out = compiled[s](*inputs[s][i])
            leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            outs[s][i] = [(t.shape, t.dtype, t.device, t.requires_grad) for t in leaves]
            pending[(s, i)] = pm.loss_fn(out, targets[i]) if s == last else leaves
            del out, leaves
            saved = live.now if saved is None else saved
            continue
        peak, in_flight, live.peak, before = live.peak, len(pending), live.now, live.now
        with pm.grad_sync.step_boundary(last=i == m - 1):
            if s == last:
                pending.pop((s, i)).backward()
            else:
                grads = [t for t in pending.pop((s, i)) if t.requires_grad]
                torch.autograd.backward(grads, [torch.empty_like(t) for t in grads])
        if split:
            weights[(s, i)] = pm.grad_sync.take_w()
            stash = max(stash, live.now - before + saved)
            if kind == "BW":  # a whole backward under B and W: its W at once
                weights.pop((s, i))()
        above.append(live.peak - in_flight * saved)
        live.peak = max(peak, live.peak)
    pm.grad_sync.flush()
    return outs, saved, above, stash
