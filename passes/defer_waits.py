"""Return a graph's collectives in flight: whoever runs it waits for them later, outside it.

Invariant established: no `wait_tensor` read only by the output remains; the output holds the collective's
own result in its place, and the input of each such collective is appended to the outputs, so the caller
keeps it alive while the collective may still read it (Inductor frees or reuses a buffer after its last use
in the graph, which without the wait is the collective itself). Nothing in the graph reads a deferred
result. Collectives keep their order and every other node stays, so `meta["val"]` stays correct.

Assumes: functional collectives (each `wait_tensor` reads the collective it waits on), and that the caller
runs `wait_tensor` on each deferred output (`DeferRecord.deferred`) before reading it, and drops the kept
inputs only after that. Graphs whose outputs alias a deferred result (an all-reduced bucket's views) keep
those waits: their views would be read before the collective completes.

Run last, on the copy that is compiled (after the agreement, whose zero is the first collective's true input),
by gradsched.sync.compile for the early reductions of a rank of several stages (gradsched/sync/early_reduce.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass(frozen=True)
class DeferRecord:
    deferred: tuple[int, ...]  # output positions now holding an un-waited collective's result
    kept: int  # inputs of those collectives appended to the outputs, in order


def defer_waits(gm: fx.GraphModule) -> tuple[fx.GraphModule, DeferRecord]:
    out = gm.graph.output_node()
    outputs = list(out.args[0])
    waits = {o for o in outputs if isinstance(o, fx.Node) and o.op == "call_function" and o.target is WAIT
             and set(o.users) == {out}}
    deferred, kept = [], []
    for i, o in enumerate(outputs):
        if o in waits:
            collective = o.args[0]
            outputs[i] = collective
            deferred.append(i)
            kept += [a for a in collective.args if isinstance(a, fx.Node) and a not in kept]
    out.args = (tuple(outputs) + tuple(kept),)
    for w in waits:
        gm.graph.erase_node(w)
    gm.graph.lint()
    gm.recompile()
    return gm, DeferRecord(tuple(deferred), len(kept))
