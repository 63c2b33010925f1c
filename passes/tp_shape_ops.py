"""How the tensor-parallel pass carries a split value through shape, pointwise and reduction ops.

A mixin of passes/tensor_parallel.py's rewriter: each method sets the node's layout (passes/tp_layouts.py)
from its inputs', rewrites literal sizes to this rank's, slices a value every rank holds whole where it
meets a split one, and refuses (TensorParallelError, naming the source line) what would mix the chunks of
a split dimension: a reduction over it, a reshape that interleaves it, a partial indexing of it.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import set_fake
from .tp_layouts import (BODIES, FULL, Layout, TensorParallelError, aligned_dim, local_shape, normalize_dim,
                         take_chunk, view_dim)
from .tp_roles import is_op, where


class ShapeOps:
    def _getitem(self, node) -> None:
        src, index = node.args
        lay = self._l(src)
        out_dim = _index_dim(index, self.whole[src].dim(), lay.dim, self.whole[src].shape, node)
        self.lay[node] = lay.at(out_dim)

    def _view(self, node) -> None:
        x = node.args[0]
        lay = self._l(x)
        whole_in, whole_out = tuple(self.whole[x].shape), tuple(self.whole[node].shape)
        d = view_dim(whole_in, whole_out, lay.dim, lay.segments, self.spec.tp)
        if d is None and lay.kind == "seq":
            x = self._gather(x, lay, node)
            node.args = (x,) + tuple(node.args[1:])
            self.lay[node] = FULL
            return
        if d is None:
            raise TensorParallelError(f"the reshape at {where(node)} from {whole_in} to {whole_out} would mix "
                                      f"the chunks of dimension {lay.dim}, split over tp={self.spec.tp}.")
        out = Layout(lay.kind, d, lay.segments)
        if is_op(node, (torch.flatten,), {"flatten"}):
            self.lay[node] = out
            return
        node.args = (x, local_shape(whole_out, out, self.spec.tp))
        node.kwargs = {}
        self.lay[node] = out

    def _transpose(self, node) -> None:
        x, a, b = node.args[0], *node.args[1:3]
        nd = self.whole[x].dim()
        a, b = normalize_dim(a, nd), normalize_dim(b, nd)
        lay = self._l(x)
        self.lay[node] = lay.at(b if lay.dim == a else a if lay.dim == b else lay.dim)

    def _split(self, node) -> None:
        x = node.args[0]
        lay = self._l(x)
        nd = self.whole[x].dim()
        dim = normalize_dim(node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0), nd)
        pieces = len(self.whole[node])
        if dim != lay.dim:
            self.lay[node] = tuple(lay for _ in range(pieces))
            return
        if lay.segments != pieces:
            raise TensorParallelError(f"the split at {where(node)} cuts dimension {dim}, split over tp, into "
                                      f"{pieces} pieces, not into the {lay.segments} blocks its projection holds.")
        if node.target != "chunk":  # chunk(n) of the local value is already right
            sizes = node.args[1]
            local = [s // self.spec.tp for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // self.spec.tp
            node.args = (x, local) + tuple(node.args[2:])
        self.lay[node] = tuple(Layout(lay.kind, dim) for _ in range(pieces))

    def _cat(self, node) -> None:
        tensors = [t for t in node.args[0] if self.whole[t].numel() > 0]
        dim = normalize_dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0), self.whole[node].dim())
        lays = {self._l(t) for t in tensors}
        if len(lays) != 1 or next(iter(lays)).dim == dim:
            raise TensorParallelError(f"the concatenation at {where(node)} joins values laid out "
                                      f"{', '.join(map(str, lays))} along dimension {dim}.")
        self.lay[node] = lays.pop()

    def _norm(self, node) -> None:
        x = node.args[0]
        lay = self._l(x)
        shape = node.args[1]
        if lay.dim >= self.whole[x].dim() - len(shape):
            raise TensorParallelError(f"the norm at {where(node)} normalises over dimension {lay.dim}, split over tp.")
        self.lay[node] = lay

    def _reduction(self, node) -> None:
        x = node.args[0]
        lay, nd = self._l(x), self.whole[x].dim()
        # where dim and keepdim sit: Tensor.norm(p, dim, keepdim), var/std(dim, unbiased, keepdim), else (dim, keepdim)
        at_dim, at_keep = {"norm": (2, 3), "var": (1, 3), "std": (1, 3)}.get(node.target, (1, 2))
        dims = node.kwargs.get("dim", node.args[at_dim] if len(node.args) > at_dim else None)
        dims = tuple(range(nd)) if dims is None else (dims,) if isinstance(dims, int) else tuple(dims)
        dims = {normalize_dim(d, nd) for d in dims}
        if lay.dim in dims:
            what = "the sequence" if lay.kind == "seq" else "heads or features split over tp"
            raise TensorParallelError(f"the {node.target} at {where(node)} reduces over {what} (dimension "
                                      f"{lay.dim}): each rank holds only its chunk. Train this model with tp=1.")
        keep = node.kwargs.get("keepdim", node.args[at_keep] if len(node.args) > at_keep else False)
        if node.target in ("softmax", "log_softmax") or node.target in (torch.softmax, F.softmax):
            keep = True
        self.lay[node] = lay.at(lay.dim - (0 if keep else sum(1 for d in dims if d < lay.dim)))

    def _pointwise(self, node) -> None:
        """Operands' layouts agree; a value every rank holds whole that spans the split dimension is sliced."""
        out_nd = self.whole[node].dim()
        target = None
        # x.type_as(y) and x.to(y) read only y's dtype: y's layout is not the result's
        operands = node.args[:1] if is_op(node, (), {"type_as", "to"}) else node.all_input_nodes
        for a in operands:
            l = self._l(a)
            if l.split:
                t = Layout(l.kind, aligned_dim(out_nd, self.whole[a].dim(), l.dim), l.segments)
                if target is not None and t != target:
                    raise TensorParallelError(f"the op at {where(node)} combines values laid out {target} and {t}.")
                target = t
        if target is None:  # only a dtype donor is split
            self.lay[node] = FULL
            return
        for a in [a for a in operands if isinstance(a, fx.Node)]:
            v = self.whole.get(a)
            if self._l(a).split or not isinstance(v, torch.Tensor):
                continue
            d = target.dim - (out_nd - v.dim())
            if d >= 0 and v.shape[d] != 1:
                sliced = self._slice(a, d, target.segments, node)
                node.replace_input_with(a, sliced)
        self.lay[node] = target


def _index_dim(index, ndim: int, dim: int, shape, node) -> int:
    """The output dimension of input dimension `dim` under tensor indexing `index`; the split dimension
    itself may only be taken whole."""
    index = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in index):
        raise TensorParallelError(f"the indexing at {where(node)} takes a tensor, list or boolean index on a value "
                                  "split over tp, whose dimensions it may move or merge: index it with slices, or "
                                  "train with tp=1.")
    explicit = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded = []
    for i in index:
        expanded.extend([slice(None)] * (ndim - explicit) if i is Ellipsis else [i])
    expanded += [slice(None)] * (ndim - sum(1 for i in expanded if i is not None))
    src = out = 0
    for i in expanded:
        if i is None:
            out += 1
            continue
        if src == dim:
            whole = isinstance(i, slice) and i.step in (None, 1) and (i.start or 0) == 0 and \
                (i.stop is None or i.stop >= shape[dim])
            if not whole:
                raise TensorParallelError(f"the indexing at {where(node)} takes part of dimension {dim}, "
                                          "split over tp: each rank holds only its chunk.")
            return out
        if not isinstance(i, int):
            out += 1
        src += 1
    return out


def propagate_local_values(gm: fx.GraphModule, whole: dict, partitions: dict, tp: int, rank: int,
                           split_inputs: dict | None = None) -> None:
    """Every node's fake value becomes its local one, in the graph and in the bodies it runs: parameter
    placeholders cut by their partitions (other inputs by `split_inputs`, placeholder -> dimension), the rest
    re-run on those (the collectives' fake kernels give their shapes)."""
    mode = next((v.fake_mode for v in whole.values() if getattr(v, "fake_mode", None) is not None), None)
    env = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        v = whole[ph]
        p = partitions.get(ph.name)
        dim, segments = (p.dim, p.segments) if p is not None else ((split_inputs or {}).get(ph), 1)
        if isinstance(v, torch.Tensor) and dim is not None:
            with mode:
                v = take_chunk(v.detach(), dim, segments, tp, rank).clone()
                v.requires_grad_(whole[ph].requires_grad)
            set_fake(ph, v)
        env[ph] = ph.meta.get("example_value", v)

    class Prop(fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and n.target in BODIES:  # the body's nodes get their local values too
                args, _ = self.fetch_args_kwargs_from_env(n)
                Prop(args[0]).run(*args[1:])
            out = super().run_node(n)
            if n.op not in ("placeholder", "output"):
                n.meta["example_value"] = out
                if "val" in n.meta:
                    n.meta["val"] = out
            return out

    with mode:
        Prop(gm).run(*[env[ph] for ph in gm.graph.find_nodes(op="placeholder")])
