"""Cut a backward graph in two: B (the gradients of the stage's inputs) and W (those of its weights).

A zero-bubble schedule runs B as soon as the next stage's gradient arrives, since the previous stage waits
for its result, and W later, in what would otherwise be the bubble. Autograd can do this only by running
the eager graph twice (torch.distributed.pipelining's stage_backward_input / stage_backward_weight); here
the compiled backward graph itself is cut in two, and each half is compiled on its own.

Invariant established: with `b, w = record.b, record.w`,
  b(*(inputs[i] for i in record.b_inputs))  == (the original outputs at `record.input_outputs`, in order) + stash
  w(*stash, *(inputs[i] for i in record.w_inputs)) == the original outputs at `record.weight_outputs`
for the original graph's inputs, value for value: the halves run the original nodes, in the original
order, on the same values. Every call_function node of the original that an output needs (or that has
an effect) is in exactly one half (nothing is computed twice; dead nodes are dropped); B holds exactly the ancestors of the input gradients (so B is as short as the next
stage's wait can be), W the rest that the weight gradients need; `stash` is the B values W reads, the
only thing kept from B for W besides W's own inputs. B takes only the inputs it reads (an input W alone reads,
such as the gradient accumulated so far, can then be read when W runs). node.meta (with "val") is carried over.

Assumes: `gm` is functional (AOTAutograd's backward graph: no mutation of its inputs), its output is one
flat tuple of nodes and Nones, and `spec.weight_outputs` names the positions of the weight gradients
(every other position is an input gradient). A node with side effects that neither half needs (a
collective's wait nobody reads) goes with W if it depends on W's work, else with B.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class CutSpec:
    weight_outputs: frozenset[int]  # positions in the graph's output tuple holding weight gradients


@dataclass
class CutRecord:
    b: fx.GraphModule
    w: fx.GraphModule
    input_outputs: list[int]  # original output positions B returns first, in order
    weight_outputs: list[int]  # original output positions W returns, in order
    stash: list[str]  # names of the B values W reads (B returns them after the input gradients)
    w_inputs: list[int]  # positions of the original placeholders W reads, after the stash
    b_inputs: list[int]  # positions of the original placeholders B reads, in order
    b_nodes: int  # call_function nodes in each half
    w_nodes: int


def _ancestors(roots, stop: set) -> set:
    """Nodes the roots depend on (roots included), not walking through `stop`."""
    seen, todo = set(), [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def cut_backward(gm: fx.GraphModule, spec: CutSpec) -> tuple[fx.GraphModule, CutRecord]:
    """(B, record): see the module docstring. `gm` is left as it was."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = list(graph.output_node().args[0])
    bad = sorted(i for i in spec.weight_outputs if not 0 <= i < len(outputs))
    if bad:
        raise ValueError(f"cut_backward: weight output positions {bad} are outside the graph's {len(outputs)} "
                         "outputs")
    input_outputs = [i for i in range(len(outputs)) if i not in spec.weight_outputs]
    weight_outputs = sorted(spec.weight_outputs)
    ph = set(placeholders)
    in_b = _ancestors([outputs[i] for i in input_outputs], ph) - ph
    in_w = _ancestors([outputs[i] for i in weight_outputs], ph | in_b) - ph
    for n in graph.nodes:  # effects nobody reads: kept, with the half they depend on (B's when either)
        if n.op == "call_function" and n not in in_b and n not in in_w and n.is_impure():
            needs = _ancestors([n], ph | in_b) - ph
            if any(a in in_w for a in needs):
                in_w |= needs
            else:
                in_b |= needs
    stash = [n for n in graph.nodes if n in in_b and any(u in in_w for u in n.users)]
    stash += [outputs[i] for i in weight_outputs if outputs[i] in in_b and outputs[i] not in stash]
    w_reads = {a for n in in_w for a in n.all_input_nodes} | {outputs[i] for i in weight_outputs}
    w_inputs = [i for i, p in enumerate(placeholders) if p in w_reads]
    b_reads = {a for n in in_b for a in n.all_input_nodes} | {outputs[i] for i in input_outputs} | set(stash)
    b_inputs = [i for i, p in enumerate(placeholders) if p in b_reads]

    b = _subgraph(gm, [placeholders[i] for i in b_inputs], [n for n in graph.nodes if n in in_b],
                  [outputs[i] for i in input_outputs] + stash)
    w = _subgraph(gm, stash + [placeholders[i] for i in w_inputs], [n for n in graph.nodes if n in in_w],
                  [outputs[i] for i in weight_outputs])
    count = lambda g: sum(n.op == "call_function" for n in g.graph.nodes)  # noqa: E731
    return b, CutRecord(b, w, input_outputs, weight_outputs, [n.name for n in stash], w_inputs, b_inputs,
                          count(b), count(w))


def _subgraph(gm: fx.GraphModule, inputs: list[fx.Node], body: list[fx.Node], outputs: list) -> fx.GraphModule:
    """A graph taking `inputs` (as placeholders, names kept), running `body` in order, returning `outputs`."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    g.lint()
    return fx.GraphModule(gm, g)
