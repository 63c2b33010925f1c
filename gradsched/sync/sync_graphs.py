"""The graphs a stage reduces its buckets in, built from the stage's SyncPlan (buckets and placement,
from `plan_sync`) by the pass pipeline's entries for a sync graph (gradsched.sync.pass_pipeline):

  backward_sync_graph   a copy of the stage's backward graph, run on the step's last micro-batch, the
                        accumulated gradients of earlier micro-batches as extra inputs
  flush_sync_graph      a graph of the flush's gradients alone, run after the schedule has drained; the
                        same for an early graph of a rank of several stages

Each returns the graph and insert_grad_sync's SyncRecord, which says how to feed and read it.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from gradsched.passes.grad_sync import SyncRecord

from gradsched.sync import pass_pipeline
from gradsched.sync.sync_plan import SyncPlan


def backward_sync_graph(bw_gm: fx.GraphModule, plan: SyncPlan, accumulate: bool) -> tuple[fx.GraphModule, SyncRecord]:
    gm = fx.GraphModule(bw_gm, bw_gm.graph.__deepcopy__())
    gm.meta.update(bw_gm.meta)
    mine = plan.names("backward")
    grad_outputs = {r.name: r.output_index for r in plan.ready if r.name in mine}
    records = pass_pipeline.run("sync", gm, _conditions(plan, "backward"),
                                {"insert_grad_sync": plan.spec("backward", grad_outputs, accumulate),
                                 "sink_waits": None}, what=f"stage {plan.stage} backward graph")
    return gm, records["insert_grad_sync"]


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
    spec = plan.spec(where, {r.name: i for i, r in enumerate(plan.inputs(where))}, False)
    records = pass_pipeline.run("sync", gm, _conditions(plan, where), {
        "insert_grad_sync": spec, "return_shards_only": pass_pipeline.Later(lambda r: r["insert_grad_sync"].n_outputs),
        "sink_waits": None}, what=f"stage {plan.stage} {where} graph")
    return gm, records["insert_grad_sync"]


def _conditions(plan: SyncPlan, where: str) -> pass_pipeline.Conditions:
    return pass_pipeline.Conditions(shard=plan.shard, where=where)
