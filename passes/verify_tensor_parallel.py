"""Static verifier of a tensor-parallel backward graph: every gradient is reduced over TP as its partition needs.

For each parameter gradient the graph returns, over the graph's data-flow (networkx), it proves:

  replicated over TP  exactly one all-reduce over the TP group is an ancestor of the gradient, and
                      with it removed no path is left from any input of the graph (the incoming
                      gradients, the saved activations) to the gradient: every rank's share is summed,
                      once, before anything (the data-parallel reduction, the optimizer) reads it;
  sharded over TP     no all-reduce over the TP group is an ancestor of the gradient: a shard's
                      gradient is already whole on its rank, and a sum over TP would add other
                      ranks' unrelated shards (or count it tp times).

Megatron #1446 and #1528 (norm gradients not summed, or summed twice, under sequence parallelism) are
the first kind of failure; the second is what a hand-kept list of "sequence-parallel parameters" gets
wrong when a sharded bias is added to it. Invariant: none established; it reads the graph only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx

from .graph_utils import collective_group, collective_kind, is_collective


@dataclass(frozen=True)
class TensorParallelGradSpec:
    group: str  # the TP group's name
    grads: dict  # backward output index -> (parameter name, replicated: bool)


@dataclass
class TensorParallelProof:
    ok: bool = True
    proved: list = field(default_factory=list)  # (parameter, "summed once" | "never summed")
    hazards: list = field(default_factory=list)  # what is wrong, naming the parameter

    def raise_if_unsafe(self) -> None:
        if not self.ok:
            raise TensorParallelHazard("tensor-parallel gradients are not reduced as their partitions need: "
                                       + "; ".join(self.hazards))


class TensorParallelHazard(RuntimeError):
    """A backward graph whose TP reductions do not match its parameters' partitions."""


def verify_tensor_parallel(gm: fx.GraphModule, spec: TensorParallelGradSpec) -> TensorParallelProof:
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n)
        for a in n.all_input_nodes:
            g.add_edge(a, n)
    sums = {n for n in gm.graph.nodes if is_collective(n) and collective_kind(n) == "all_reduce"
            and collective_group(n) == spec.group}
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = gm.graph.output_node().args[0]
    proof = TensorParallelProof()
    if not spec.grads:
        proof.hazards.append("no gradient of the graph could be matched to a parameter (no AOTAutograd output "
                             "descriptors?): nothing was proved")
    for index, (name, replicated) in sorted(spec.grads.items()):
        grad = outputs[index] if index < len(outputs) else None
        if not isinstance(grad, fx.Node):
            continue  # no gradient (an unused parameter)
        above = nx.ancestors(g, grad) & sums
        if not replicated:
            if above:
                proof.hazards.append(f"{name} is split over TP, but its gradient is summed over the TP group "
                                     f"({', '.join(n.name for n in above)}): other ranks' shards are added to it")
            else:
                proof.proved.append((name, "never summed"))
            continue
        if len(above) != 1:
            proof.hazards.append(f"{name} is whole on every TP rank, but its gradient meets {len(above)} sums over "
                                 "the TP group instead of one" + (": each rank would keep only its own share"
                                                                  if not above else ": it is counted more than once"))
            continue
        cut = g.copy()
        cut.remove_nodes_from(above)
        leak = [i for i in inputs if i in cut and nx.has_path(cut, i, grad)]
        if leak:
            proof.hazards.append(f"{name}'s gradient also reads {leak[0].name} around its TP sum: that share "
                                 "would be kept by one rank only")
        else:
            proof.proved.append((name, "summed once"))
    proof.ok = not proof.hazards
    return proof
