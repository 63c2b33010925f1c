"""Loss parallel after a pipeline's last stage: the loss of logits that arrive as this TP rank's vocabulary columns.

Under pp > 1, torch's pipelining calls the loss on the last stage's output, outside the stage's graph. With
tensor parallelism that stage leaves its LM head's logits split over the vocabulary (the pass's
`vocab_output`), so nothing gathers them; the loss is then a graph of its own, made as the stage's graphs are:

- traced by Dynamo as one process holds it (whole logits, on the meta device: nothing is allocated),
- split by the tensor-parallel pass with the logits input laid out as this rank's columns, so a cross-entropy
  over them becomes gradsched.tp.loss_parallel (max, sum-exp and the target's logit reduced over TP, the
  backward local) and every shape in the graph becomes the rank's,
- compiled through AOTAutograd over the local logits (gradsched.tp.local_graph.compile_local).

A loss the pass cannot split (an op that needs the whole vocabulary other than the cross-entropy), or that Dynamo
cannot trace whole, runs as before loss parallel: the logits gathered over TP (their backward keeps this rank's
columns), the loss eagerly on them, with a warning that names why.
"""
from __future__ import annotations

import dataclasses
import types
import warnings

import torch
import torch.fx as fx

from gradsched.passes.tp_layouts import TensorParallelError
from gradsched.sync.compile import compile_graph
from gradsched.tp.collectives import gather_output
from gradsched.tp.local_graph import compile_local, tensor_parallel_spec
from gradsched.training import loss_weights


class VocabParallelLoss:
    """loss_weights.gated(loss_fn, logits, target, keep, weight) from this rank's vocabulary columns of the
    logits, compiled once for each shape. `outputs` is filled by the backend while the last stage compiles:
    the dimension its output is split along, when the pass left it split (empty: the output is whole)."""

    def __init__(self, loss_fn, plan, compiler: str):
        self.loss_fn, self.plan, self.compiler = loss_fn, plan, compiler
        self.outputs: list[int] = []
        self.shapes: list[tuple] = []  # the local logits' shape of each loss compiled loss-parallel
        self._compiled: dict = {}

    @property
    def active(self) -> bool:
        return bool(self.outputs)

    def __call__(self, out, target, keep, weight):
        key = (tuple(out.shape), out.dtype, tuple(target.shape), target.dtype)
        if key not in self._compiled:
            self._compiled[key] = self._compile(out, target, keep, weight)
        return self._compiled[key](out, target, keep, weight)

    def _compile(self, out, target, keep, weight):
        try:
            fn = self._split_loss(out, target, keep, weight)
        except (TensorParallelError, torch._dynamo.exc.Unsupported) as e:
            warnings.warn(f"gradsched: loss_fn could not run loss-parallel over tp={self.plan.tp} "
                          f"({str(e).splitlines()[0]}); the last stage's logits are gathered whole for it instead. "
                          "Compute the loss with F.cross_entropy on [tokens, vocab] logits to keep them split.",
                          stacklevel=4)
            return self._gathered_loss
        self.shapes.append(tuple(out.shape))
        return fn

    def _gathered_loss(self, out, target, keep, weight):
        tp = self.plan.tp
        whole = gather_output(out, self.outputs[0], self.plan.process_group("tp").group_name, tp, self.plan.index("tp"))
        return loss_weights.gated(self.loss_fn, whole, target, keep, weight)

    def _split_loss(self, out, target, keep, weight):
        tp, dim = self.plan.tp, self.outputs[0]
        shape = list(out.shape)
        shape[dim] *= tp
        whole = torch.empty(shape, dtype=out.dtype, device="meta", requires_grad=True)
        gm, order = _trace(self.loss_fn, (whole, target.to("meta"), keep.to("meta"), weight.to("meta")), out.device)
        # no value of a loss graph is split along the sequence: any length tp divides will do
        spec = dataclasses.replace(tensor_parallel_spec(self.plan, tp), vocab_inputs=(order.index(0),))
        inner = lambda g, ins: compile_graph(g, ins, self.compiler)  # noqa: E731
        example = [out.detach().requires_grad_(out.requires_grad), target, keep, weight]
        forward = compile_local(gm, [example[i] for i in order], spec, inner).forward
        return lambda *args: forward(*[args[i] for i in order])[0]  # Dynamo's graph returns a list


def _trace(loss_fn, meta_args: tuple, device) -> tuple[fx.GraphModule, list[int]]:
    """Dynamo's graph of the gated loss on meta arguments (whole shapes), every meta device in it made `device`,
    and the argument each of its inputs is (Dynamo lifts them in the order first read)."""
    def gated_loss(out, target, keep, weight):
        return loss_weights.gated(loss_fn, out, target, keep, weight, in_graph=True)
    # a code object of its own: Dynamo caches per code object (see global_loss._compiled_gated)
    own = types.FunctionType(gated_loss.__code__.replace(), gated_loss.__globals__, "vocab_parallel_loss",
                             gated_loss.__defaults__, gated_loss.__closure__)
    seen, names = [], ["out", "target", "keep", "weight"]

    def capture(gm, example_inputs):  # the sources are read here: Dynamo drops them from the graph after
        seen.append((gm, [names.index(ph.meta["grapharg"].source.local_name)
                          for ph in gm.graph.find_nodes(op="placeholder")]))
        return gm.forward
    torch.compile(own, backend=capture, fullgraph=True, dynamic=False)(*meta_args)
    gm, order = seen[0]
    meta = torch.device("meta")
    swap = lambda a: device if isinstance(a, torch.device) and a == meta else a  # noqa: E731
    for n in gm.graph.nodes:
        n.args = torch.utils._pytree.tree_map(swap, n.args)
        n.kwargs = torch.utils._pytree.tree_map(swap, n.kwargs)
    gm.recompile()
    return gm, order
