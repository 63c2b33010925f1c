"""The gradient-sync pass pipeline on the graphs a stage reduces in, named step by step.

Given the stage's SyncPlan (buckets and placement, from `plan_sync`):

  backward_sync_graph   a copy of the stage's backward graph, run on the step's last micro-batch:
                        insert_grad_sync (with the accumulated gradients of earlier micro-batches
                        as extra inputs), then sink_waits
  flush_sync_graph      a graph of the flush's gradients alone, run after the schedule has
                        drained: insert_grad_sync, its outputs cut to the reduced shards
                        (shard=True), then sink_waits; the same for an early graph of a rank of
                        several stages (its waits deferred when compiled: passes/defer_waits.py)

Each returns the graph and the pass's SyncRecord, which says how to feed and read it. The
verifier runs later, before the graph's first collective, when the other ranks' layouts are
known (gradsched.sync.preflight). `GRADSCHED_PRINT_GRAPHS=1` prints the graphs before and after.
"""
from __future__ import annotations

import os

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from gradsched.passes import insert_grad_sync, sink_waits
from gradsched.passes.grad_sync import SyncRecord

from gradsched.sync.sync_plan import SyncPlan


def backward_sync_graph(bw_gm: fx.GraphModule, plan: SyncPlan, accumulate: bool) -> tuple[fx.GraphModule, SyncRecord]:
    print_graph(bw_gm, f"stage {plan.stage} backward graph, before the gradient-sync passes")
    gm = fx.GraphModule(bw_gm, bw_gm.graph.__deepcopy__())
    gm.meta.update(bw_gm.meta)
    mine = plan.names("backward")
    grad_outputs = {r.name: r.output_index for r in plan.ready if r.name in mine}
    _, record = insert_grad_sync(gm, plan.spec("backward", grad_outputs, accumulate))
    sink_waits(gm)
    print_graph(gm, f"stage {plan.stage} backward graph, after insert_grad_sync and sink_waits")
    return gm, record


def flush_sync_graph(plan: SyncPlan, device: torch.device, where: str = "flush") -> tuple[fx.GraphModule, SyncRecord]:
    """Inputs: the gradients graph `where` reduces (the flush, or an early graph of a rank of several stages),
    in `plan.inputs(where)` order, on `device` (the parameters')."""
    g, fake = fx.Graph(), FakeTensorMode()
    phs = []
    for i, r in enumerate(plan.inputs(where)):
        ph = g.placeholder(f"grad_{i}")
        with fake:  # a fake tensor may sit on a device this machine lacks (CUDA in CPU tests)
            ph.meta["val"] = torch.empty(r.shape, dtype=r.dtype, device=device)
        phs.append(ph)
    g.output(tuple(phs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    _, record = insert_grad_sync(gm, plan.spec(where, {r.name: i for i, r in enumerate(plan.inputs(where))}, False))
    if plan.shard:  # the gradient outputs are None: return the shards only
        out = gm.graph.output_node()
        out.args = (tuple(out.args[0][record.n_outputs:]),)
        gm.recompile()
    sink_waits(gm)
    print_graph(gm, f"stage {plan.stage} {where} graph, after insert_grad_sync and sink_waits")
    return gm, record


def print_graph(gm: fx.GraphModule, what: str) -> None:
    if os.environ.get("GRADSCHED_PRINT_GRAPHS"):
        print(f"==== gradsched: {what} ====\n{gm.print_readable(print_output=False)}", flush=True)
