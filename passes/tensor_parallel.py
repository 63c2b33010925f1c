"""Split a model's layers over the TP group, found from the Dynamo graph (before AOTAutograd).

Invariant: after `shard_for_tensor_parallel`, the graph is ONE TP rank's part of the same
computation, with Megatron's tensor and sequence parallelism:

- each attention call's q/k/v projections (found by dataflow from the call's q, k and v, through
  shape ops, rotary and q/k norms) are column-parallel, heads split over tp, a fused projection's
  blocks each split alike; the projection reading the attention output is row-parallel;
- an MLP (a linear whose input is a pointwise function of linears alone: gelu(fc(x)),
  silu(gate(x)) * up(x)) has those linears column-parallel and itself row-parallel;
- the LM head (a linear left over whose output is a graph output) is column-parallel over the
  vocabulary, and the embedding over the same vocabulary (the head's own weight when tied)
  vocab-parallel over the same ranges: a tie stays one weight per TP rank;
- between them the tokens are sequence-parallel: a row-parallel product and the vocab-parallel
  lookup are reduce-scattered along the sequence, and every column-parallel projection reads an
  all-gather of it; a value every rank holds whole that meets a sequence shard is sliced alike;
- every parameter left whole on each rank (norms, biases after a row-parallel product, position
  embeddings) passes through `spec.grad_sum`, so its gradient is the sum of every rank's share;
  a sharded parameter's never is;
- a cross-entropy over the vocab-parallel logits becomes `spec.cross_entropy` (loss parallel: the
  logits are never gathered); any other output is whole (`spec.gather_output`, whose backward keeps
  this rank's chunk, since every rank computes the same loss from it).

The body of a higher-order op that runs it inline (activation checkpointing, wrap) is rewritten the same
way, with its operands' layouts; its collectives are recomputed with it in the backward.

Where each op goes: passes/tp_roles.py finds the roles, passes/tp_shape_ops.py, tp_heads.py and
tp_vocab.py rewrite shape and pointwise ops, attention, and the embedding and loss, tp_checks.py
refuses what one rank's part cannot compute as one process does; this module
walks the graph, places the parameters and inserts the collectives.

Parameter placeholders then stand for this rank's shard (`record.partitions`, by placeholder name;
gradsched.tp.local_shards.local_shard cuts it) and every node's meta["example_value"] / meta["val"] is
its local value. The collectives come from `spec` (the runtime's, passes import no runtime), over
the group `spec.group`, in graph order, so every rank of the group issues the same ones.

Refused, naming the source line (TensorParallelError): an op that mixes heads or reduces over the
sequence on a rank's shard, a size that tp does not divide where it is split, a parameter that two
uses would split differently, any op the pass does not know on a split value, and a result computed
whole on every rank from all-gathered tokens that reaches an output or the loss (the all-gather's
backward would sum its gradient tp times).

Assumes: every rank of the TP group compiles the same graph from the same model, static shapes,
a token input [B, S] whose S is `spec.seq_len`, and SDPA's [B, H, S, D] layout.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from .tp_layouts import (BODIES, FULL, PARTIAL, REPLICATED, Layout, Partition, Seq, Shard, TensorParallelError, check_divisible, local_shape,
                         normalize_dim, take_chunk)
from .tp_roles import (EMBEDDING, NORMS, REDUCTIONS, VIEWS, find_roles, is_linear, is_op, is_sdpa, is_param,
                       is_pointwise, linear_parts, override_roles, segments_of, set_linear_parts, where)
from .tp_heads import Heads
from .tp_shape_ops import ShapeOps, propagate_local_values
from .tp_vocab import Vocab
from .tp_checks import Checks

@dataclass(frozen=True)
class TensorParallelSpec:
    tp: int
    rank: int  # this rank's index in the TP group
    group: str  # the TP group's name
    seq_len: int  # S of the token input, which sequence parallelism splits
    gather_sequence: Callable  # (x, dim, group, tp) -> all-gather; backward reduce-scatter
    scatter_sequence: Callable  # (x, dim, group, tp) -> reduce-scatter; backward all-gather
    grad_sum: Callable  # (w, group) -> w; backward all-reduce
    gather_output: Callable  # (x, dim, group, tp, rank) -> all-gather; backward this rank's chunk
    cross_entropy: Callable | None = None  # (logits, target, lo, vocab, group, ignore_index, reduction,
    #   label_smoothing): F.cross_entropy from this rank's vocabulary columns (None: the logits are gathered)
    scatter_input: Callable | None = None  # (x, dim, group, tp, rank) -> this rank's sequence chunk of a whole
    #   input; backward all-gather (a pipeline stage's received activation; None: such an input is refused)
    roles: tuple = ()  # (parameter placeholder name, "column" | "row" | "replicated"): the user's overrides of
    #   the role found for the linear or embedding that reads that weight (gradsched option tp_plan)
    vocab_inputs: tuple = ()  # indices of inputs that arrive as this rank's vocabulary columns (a loss's logits)
    vocab_output: bool = False  # a lone output split over the vocabulary stays so (a last pipeline stage whose
    #   loss runs loss-parallel outside its graph: gradsched.training.vocab_parallel_loss); else it is gathered


@dataclass
class TensorParallelRecord:
    partitions: dict = field(default_factory=dict)  # parameter placeholder name -> Partition
    roles: dict = field(default_factory=dict)  # linear/embedding node name -> its role
    collectives: list = field(default_factory=list)  # (kind, node name) in graph order
    vocab_output: int | None = None  # the dimension of the output left split over the vocabulary (vocab_output)


def shard_for_tensor_parallel(gm: fx.GraphModule, spec: TensorParallelSpec):
    """The pass (see the module docstring): (gm rewritten in place, TensorParallelRecord)."""
    if spec.seq_len % spec.tp:
        raise TensorParallelError(f"sequence parallelism splits the {spec.seq_len} tokens of each sequence over "
                                  f"tp={spec.tp}: use a sequence length divisible by {spec.tp}.")
    params = {n: n for n in gm.graph.find_nodes(op="placeholder") if is_param(n)}
    roles = override_roles(find_roles(gm.graph, params, spec.tp), gm.graph, dict(spec.roles))
    rewriter = _Rewriter(gm, spec, roles, params)
    rewriter.run()
    gm.graph.lint()
    gm.recompile()
    return gm, rewriter.record


# ---- the rewrite ------------------------------------------------------------------------------------

class _Rewriter(ShapeOps, Heads, Vocab, Checks):
    def __init__(self, gm, spec: TensorParallelSpec, roles: dict, params: dict, outer=None, operands=()):
        self.gm, self.graph, self.spec, self.roles = gm, gm.graph, spec, roles
        self.params = params
        self.outer = outer  # a body's: the rewriter of the graph whose higher-order op runs it
        self.operand_of = dict(zip(gm.graph.find_nodes(op="placeholder"), operands))  # a body's placeholder -> operand
        # a body's replicated parameters (summed in the outer graph), in the order first read: a set's order
        # would differ across ranks, and the sums' all-reduces with it (same shapes: silently mixed)
        self.replicated_inside: dict = {}
        self.record = outer.record if outer else TensorParallelRecord()
        self.record.roles.update({n.name: r for n, r in roles.items()})
        self.lay: dict = {}  # node -> Layout (a tuple of them for a split's pieces)
        self.whole: dict = {}  # node -> its whole (one-process) fake value, read before any rewrite
        for n in self.graph.nodes:
            self.whole[n] = n.meta.get("example_value", n.meta.get("val"))
        self.gathered: dict = {}  # sequence-sharded node -> its all-gather
        self.reduced: dict = {}  # partial node -> its reduction
        self.bias_of: dict = {}  # partial node -> the bias to add after its reduction
        self.summed: dict = {}  # replicated parameter placeholder -> its grad_sum node

    # partitions ---------------------------------------------------------------------------------
    def _assign(self, ph: fx.Node, partition: Partition, at: fx.Node) -> None:
        if self.outer is not None:  # a body's parameter is the outer graph's
            return self.outer._assign(self.operand_of[ph], partition, at)
        old = self.record.partitions.get(ph.name)
        if old is not None and (old.dim, old.segments) != (partition.dim, partition.segments):
            raise TensorParallelError(
                f"parameter {ph.name} would be split two ways: {old} and, at {where(at)}, {partition}. "
                "Untie the two uses, or train with tp=1.")
        if partition.dim is not None:
            check_divisible(self.whole[ph].shape[partition.dim], Shard(partition.dim, partition.segments),
                            self.spec.tp, f"parameter {ph.name} at {where(at)}")
        self.record.partitions[ph.name] = partition if old is None or old.role == "replicated" else old

    def _param_arg(self, node: fx.Node, ph) -> fx.Node:
        """A replicated parameter's use goes through grad_sum (inserted once, after the placeholders)."""
        if not isinstance(ph, fx.Node) or ph not in self.params:
            return ph
        if self.outer is not None:  # inside a body: summed where the outer graph passes it in
            name = self.operand_of[ph].name
            if name not in self.record.partitions:
                self._assign(ph, REPLICATED, node)
            if self.record.partitions[name].dim is None:
                self.replicated_inside.setdefault(ph, None)
            return ph
        if ph.name not in self.record.partitions:
            self._assign(ph, REPLICATED, node)
        if self.record.partitions[ph.name].dim is not None:
            return ph
        if ph not in self.summed:
            with self.graph.inserting_before(self.body):
                s = self.graph.call_function(self.spec.grad_sum, (ph, self.spec.group))
            self.summed[ph] = s
            self.whole[s] = self.whole[ph]
            self.record.collectives.append(("grad_sum", ph.name))
        return self.summed[ph]

    # collectives and slices -----------------------------------------------------------------------
    def _insert(self, before: fx.Node, fn, *args) -> fx.Node:
        with self.graph.inserting_before(before):
            return self.graph.call_function(fn, args)

    def _gather(self, x: fx.Node, lay: Layout, before: fx.Node) -> fx.Node:
        """`x` whole, all-gathered along its sequence shard (once: q, k and v read one gather)."""
        if x in self.gathered:
            return self.gathered[x]
        g = self._insert(before, self.spec.gather_sequence, x, lay.dim, self.spec.group, self.spec.tp)
        self.record.collectives.append(("all_gather", g.name))
        self.lay[g] = FULL
        self.whole[g] = self.whole[x]
        self.gathered[x] = g
        return g

    def _slice(self, x: fx.Node, dim: int, segments: int, before: fx.Node) -> fx.Node:
        s = self._insert(before, take_chunk, x, dim, segments, self.spec.tp, self.spec.rank)
        self.whole[s] = self.whole[x]
        return s

    def _reduce(self, x: fx.Node, at: fx.Node) -> fx.Node:
        """A partial value's reduction, once, right after it: reduce-scattered along the sequence, then
        its row-parallel product's bias added (on the shard, once)."""
        if x not in self.reduced:
            out, dim = self._scatter(x, at)
            b = self.bias_of.get(x)
            if b is not None:
                bias = self._param_arg(at, b)
                with self.graph.inserting_before(out.next):
                    out = self.graph.call_function(operator.add, (out, bias))
                self.lay[out], self.whole[out] = Seq(dim), self.whole[x]
            self.reduced[x] = out
        return self.reduced[x]

    def _scatter(self, x: fx.Node, at: fx.Node) -> tuple[fx.Node, int]:
        """Reduce-scatter a partial [B, S, ...] value along its sequence dimension, inserted after `x`."""
        shape = tuple(self.whole[x].shape)
        dim = next((d for d in range(len(shape) - 1) if shape[d] == self.spec.seq_len), None)
        if dim is None:
            raise TensorParallelError(f"the row-parallel product at {where(at)} has shape {shape}, with no "
                                      f"sequence dimension of {self.spec.seq_len} tokens before its last to "
                                      "reduce-scatter along: keep the tokens' [batch, sequence] dimensions there.")
        with self.graph.inserting_before(x.next):
            s = self.graph.call_function(self.spec.scatter_sequence, (x, dim, self.spec.group, self.spec.tp))
        self.record.collectives.append(("reduce_scatter", s.name))
        self.whole[s] = self.whole[x]
        self.lay[s] = Seq(dim)
        return s, dim

    # the walk ---------------------------------------------------------------------------------------
    def run(self) -> None:
        self.body = next(n for n in self.graph.nodes if n.op != "placeholder")  # grad_sum nodes go before it
        for i, node in enumerate(list(self.graph.nodes)):
            if node.op == "placeholder":
                self.lay[node] = self.outer._l(self.operand_of[node]) if self.outer else self._input_layout(i, node)
                if self.outer is None and not self.lay[node].split:
                    self._boundary_input(node)
            elif node.op == "output":
                self._output(node)
            elif node.op in ("call_function", "call_method"):
                self._visit(node)
            else:
                self.lay[node] = FULL
        self._check_gathers_feed_split_work()
        if self.outer is None:
            split = {ph: self.lay[ph].dim for ph in self.graph.find_nodes(op="placeholder") if self.lay[ph].split}
            propagate_local_values(self.gm, self.whole, self.record.partitions, self.spec.tp, self.spec.rank, split)

    def _boundary_input(self, ph: fx.Node) -> None:
        """A non-parameter floating input that needs a gradient is a pipeline stage's received activation, whole
        on every TP rank: each rank takes its sequence chunk (spec.scatter_input), whose backward all-gathers
        the gradient sent back, so it is whole and equal on every TP rank, as the sender's gather_output
        expects."""
        v = self.whole[ph]
        if is_param(ph) or not isinstance(v, torch.Tensor) or not v.is_floating_point() or not v.requires_grad:
            return
        dim = next((d for d in range(v.dim() - 1) if v.shape[d] == self.spec.seq_len), None)
        if dim is None or self.spec.scatter_input is None:
            raise TensorParallelError(
                f"input {ph.name} {tuple(v.shape)} needs a gradient (a pipeline stage's received activation) but "
                + (f"has no sequence dimension of {self.spec.seq_len} tokens before its last to split over tp."
                   if dim is None else "this runtime gives no scatter_input for it."))
        with self.graph.inserting_before(self.body):
            s = self.graph.call_function(self.spec.scatter_input, (ph, dim, self.spec.group, self.spec.tp,
                                                                   self.spec.rank))
        ph.replace_all_uses_with(s, delete_user_cb=lambda u: u is not s)
        self.record.collectives.append(("scatter_input", ph.name))
        self.whole[s] = v
        self.lay[s] = Seq(dim)

    def _l(self, a) -> Layout:
        return self.lay.get(a, FULL) if isinstance(a, fx.Node) else FULL

    def _visit(self, node: fx.Node) -> None:
        if node.target is operator.getitem and isinstance(self.lay.get(node.args[0]), tuple):
            self.lay[node] = self.lay[node.args[0]][node.args[1]]  # a piece of a split
            return
        for a in node.all_input_nodes:  # a partial sum is reduced before anything but a view reads it
            if self._l(a).kind == "partial":
                if is_op(node, (torch.reshape,), VIEWS | {"contiguous"}):  # a sum's view is the view's sum
                    self.lay[node], self.bias_of[node] = PARTIAL, self.bias_of.get(a)
                    return
                node.replace_input_with(a, self._reduce(a, node))
        if node.op == "call_function" and node.target in BODIES:
            return self._body(node)
        role = self.roles.get(node)
        if is_linear(node):
            return self._linear(node, role)
        if is_op(node, EMBEDDING):
            return self._embedding(node, role)
        self._refuse_dropout(node)
        lays = [self._l(a) for a in node.all_input_nodes]
        # replicated parameters read anywhere else (norm weights, q/k norms, biases), in lists too, are summed
        node.args = torch.utils._pytree.tree_map_only(fx.Node, lambda a: self._param_arg(node, a), node.args)
        node.kwargs = torch.utils._pytree.tree_map_only(fx.Node, lambda a: self._param_arg(node, a), node.kwargs)
        split = [l for l in lays if l.split]
        if not split:
            self.lay[node] = FULL
            return
        if is_sdpa(node):
            return self._attention(node)
        if is_op(node, (F.cross_entropy,)) and self.spec.cross_entropy is not None:
            return self._cross_entropy(node)
        if node.target is operator.getitem:
            return self._getitem(node)
        if is_op(node, (torch.reshape,), VIEWS) or is_op(node, (torch.flatten,), {"flatten"}):
            return self._view(node)
        if is_op(node, (torch.transpose,), {"transpose"}):
            return self._transpose(node)
        if is_op(node, (), {"unsqueeze"}):
            d = normalize_dim(node.args[1], self.whole[node].dim())
            l = self._l(node.args[0])
            self.lay[node] = l.at(l.dim + (1 if d <= l.dim else 0))
            return
        if is_op(node, (), {"expand"}):
            lay = self._l(node.args[0])
            out = lay.at(lay.dim + self.whole[node].dim() - self.whole[node.args[0]].dim())
            node.args = (node.args[0], local_shape(self.whole[node].shape, out, self.spec.tp))
            self.lay[node] = out
            return
        if is_op(node, (torch.split,), {"split", "chunk"}):
            return self._split(node)
        if is_op(node, (torch.cat,)):
            return self._cat(node)
        if is_op(node, NORMS):
            return self._norm(node)
        if is_op(node, (), REDUCTIONS) or is_op(node, (torch.mean, torch.sum, torch.softmax, F.softmax)):
            return self._reduction(node)
        if is_pointwise(node):
            return self._pointwise(node)
        raise TensorParallelError(f"tensor parallelism does not know {node.target} on a value split over tp "
                                  f"({', '.join(str(l) for l in split)}) at {where(node)}; train it with tp=1, "
                                  "or express the layer with linear, SDPA and pointwise ops.")

    # ops --------------------------------------------------------------------------------------------
    def _linear(self, node, role) -> None:
        x, w, b, out_dim = linear_parts(node)
        lx = self._l(x)
        if role in ("column", "head"):
            if lx.kind == "seq":
                x = self._gather(x, lx, node)
            elif lx.kind != "full":
                raise TensorParallelError(f"the column-parallel projection at {where(node)} reads a value laid "
                                          f"out {lx}.")
            segments = segments_of(node) if role == "column" else 1
            place = Partition("column" if role == "column" else "vocab", out_dim, segments)
            self._assign(w, place, node)
            if isinstance(b, fx.Node):
                self._assign(b, Partition(place.role, 0, segments), node)
            set_linear_parts(node, x, w, b)
            self.lay[node] = Shard(self.whole[node].dim() - 1, segments)
        elif role == "row":
            if lx.kind != "shard" or lx.dim != self.whole[x].dim() - 1:
                raise TensorParallelError(f"the row-parallel projection at {where(node)} reads a value laid "
                                          f"out {lx}, not split along its features.")
            self._assign(w, Partition("row", 1 - out_dim, lx.segments), node)
            set_linear_parts(node, x, w, None)  # the bias is added once, after the reduction
            self.lay[node] = PARTIAL
            self.bias_of[node] = b
        elif role == "replicated":  # keys/values with fewer heads than tp: whole on every rank, for all tokens
            if lx.kind == "seq":
                x = self._gather(x, lx, node)
            set_linear_parts(node, x, self._param_arg(node, w), self._param_arg(node, b))
            self.lay[node] = FULL
        else:  # a replicated linear: token by token on a sequence shard, or on what every rank holds
            if lx.kind == "shard":
                raise TensorParallelError(f"the projection at {where(node)} reads a value split over its "
                                          "features but was not paired as row-parallel.")
            set_linear_parts(node, x, self._param_arg(node, w), self._param_arg(node, b))
            self.lay[node] = lx

    def _body(self, node) -> None:
        """A higher-order op's body, rewritten with its operands' layouts; its outputs keep theirs (a partial
        sum is reduced inside). Its replicated parameters are summed where this graph passes them in."""
        body = getattr(self.gm, node.args[0].target)
        operands = list(node.args[1:])
        phs = list(body.graph.find_nodes(op="placeholder"))
        params = {p: p for p, o in zip(phs, operands) if o in self.params}
        roles = override_roles(find_roles(body.graph, params, self.spec.tp, heads=False), body.graph,
                               dict(self.spec.roles), dict(zip(phs, [o.name for o in operands])))
        sub = _Rewriter(body, self.spec, roles, params, outer=self, operands=operands)
        sub.run()
        body.graph.lint()
        body.recompile()
        args = list(node.args)
        for ph in sub.replicated_inside:
            i = phs.index(ph)
            args[1 + i] = self._param_arg(node, operands[i])
        node.args = tuple(args)
        self.lay[node] = tuple(sub.out_layouts)

    def _output(self, node) -> None:
        if self.outer is not None:  # a body's outputs: reduced if partial, else as they are
            outs = [self._reduce(a, node) if self._l(a).kind == "partial" else a for a in node.args[0]]
            node.args = (tuple(outs),)
            self.out_layouts = [self._l(a) for a in outs]
            return

        def whole(a):
            if not isinstance(a, fx.Node):
                return a
            if self._l(a).kind == "partial":  # a stage that ends at the embedding: reduced, then gathered whole
                a = self._reduce(a, node)
            lay = self._l(a)
            if not lay.split or self._keeps_vocab(a, lay, node):
                return a
            if lay.segments != 1:
                raise TensorParallelError(f"graph output {a.name} is a fused projection's blocks.")
            g = self._insert(node, self.spec.gather_output, a, lay.dim, self.spec.group, self.spec.tp, self.spec.rank)
            self.record.collectives.append(("all_gather", g.name))
            return g
        node.args = torch.utils._pytree.tree_map_only(fx.Node, whole, node.args)
