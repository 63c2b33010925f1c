"""Move each collective's wait to just before the first node that reads its result.

Invariant established: every `wait_tensor` stands immediately before its first
user in graph order (or before the output node, when the output is its only
user), so the compute between a collective and its wait runs while the
collective is in flight. Collectives themselves do not move: the order in which
they are issued, which every rank of a group must share, is the graph's order
before the pass. Waits that share a first user keep their relative order.

Assumes: each `wait_tensor` reads the collective it waits on (functional
collectives), and the graph is topologically sorted. Nothing else is moved, so
`meta["val"]` is untouched.

This fixes the order for the eager compiler. Inductor schedules on its own: the
graphs that reduce are compiled with its `sink_waits` and `raise_comms` comm passes
(gradsched/sync/compile.py), and tests/test_compiled_graph.py reads its generated code
(waits after the backward's last kernel, reductions spread through it).
tests/test_sink_waits.py checks the invariant on FX graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass(frozen=True)
class SinkRecord:
    moved: tuple[tuple[str, int], ...]  # (wait node, how many nodes it now stands after its old place)


def sink_waits(gm: fx.GraphModule) -> tuple[fx.GraphModule, SinkRecord]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    moves = []
    for w in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is WAIT]:
        first = min(w.users, key=order.__getitem__, default=None)
        if first is None or first is w.next:
            continue
        moves.append((w, first))
    moved = []
    for w, first in moves:  # in graph order: waits sharing a first user stay in their order
        first.prepend(w)
        moved.append((w.name, order[first] - order[w] - 1))
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm, SinkRecord(tuple(moved))
