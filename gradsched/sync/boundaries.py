"""Pipeline sends agreed with their receivers before the first send: a mismatch is named at its source.

Every rank splits the model on its own first micro-batch, so each stage's shapes come from that rank's
batch and model. Before the first step sends anything, every rank publishes what its stage will send
(its outputs' shapes and dtypes) and what it was built to receive (its inputs'), in one all-gather over
the whole job (once, at setup: a pipeline's shapes cannot change afterwards, ParallelModel refuses other
shapes). Every rank then checks each pipeline's every boundary from the same data and, on a mismatch,
raises the same error on every rank, naming the sending rank first. Without it the receiver would fail
inside the model's code (a reshape of the wrong size), blamed on its own line.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from gradsched.plan import ParallelPlan, PlanError
from gradsched.sync.watchdog import JOURNAL


def _metas(nodes) -> list[tuple]:
    out = []
    for n in nodes:
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        out.append((tuple(v.shape), str(v.dtype).replace("torch.", "")) if isinstance(v, torch.Tensor) else None)
    return out


def stage_boundary(stage_module: fx.GraphModule) -> dict:
    """{"inputs": [(shape, dtype)], "outputs": [...]}: what a split stage receives and sends."""
    g = stage_module.graph
    outs = []
    fx.node.map_arg(g.output_node().args[0], outs.append)
    return {"inputs": _metas(g.find_nodes(op="placeholder")), "outputs": _metas(outs)}


def describe(metas) -> str:
    return ", ".join(f"{list(m[0])} {m[1]}" if m else "a non-tensor" for m in metas) or "nothing"


def agree_stage_boundaries(stage_modules: dict[int, fx.GraphModule], plan: ParallelPlan, num_stages: int) -> None:
    """One all-gather over every rank of the plan (`stage_modules`: this rank's stages by index, several under
    stages_per_rank); raises PlanError on every rank when a stage would send another shape or dtype than its next
    stage was built to receive."""
    if plan.pp == 1 or not dist.is_initialized():
        return
    d, c = plan.index("dp"), plan.index("cp")
    mine = [(plan.rank, (s, d, c), stage_boundary(m)) for s, m in stage_modules.items()]
    every = [None] * plan.world
    with JOURNAL.entry("every pipeline stage's input and output shapes, agreed before the first send",
                       "collective", plan.group or dist.group.WORLD, "all_gather_object"):
        dist.all_gather_object(every, mine, group=plan.group)
    problem = mismatch([entry for entries in every for entry in entries], num_stages)
    if problem:
        raise PlanError(problem)


def mismatch(every: list, num_stages: int) -> str | None:
    """The first boundary where a sender's outputs differ from its receiver's inputs, as a message; from
    [(rank, (stage, dp, cp), {"inputs", "outputs"}), ...] of every stage of every rank (pure: testable in one
    process)."""
    at = {coords: (rank, b) for rank, coords, b in every}
    for (s, d, c), (rank, b) in sorted(at.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if s == num_stages - 1 or (s + 1, d, c) not in at:
            continue
        to, theirs = at[(s + 1, d, c)]
        if b["outputs"] != theirs["inputs"]:
            return (f"pipeline stages disagree before the first send: rank {rank} (stage {s}, dp={d}, cp={c}) "
                    f"would send {describe(b['outputs'])} to rank {to} (stage {s + 1}), which was built to receive "
                    f"{describe(theirs['inputs'])}. Each rank splits the model on its own first batch: rank {rank}'s "
                    f"batch shape or model differs from rank {to}'s. Give every rank of a pipeline batches of one "
                    "shape (the same batch size, micro-batches and sequence length) and the same model.")
    return None
