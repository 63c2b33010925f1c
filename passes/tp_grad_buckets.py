"""Bucket the TP sums of the replicated parameters' gradients: one all-reduce a dtype, not one a parameter.

Under sequence parallelism every parameter left whole on each TP rank (norm weights, biases after a
row-parallel product, a key/value projection with fewer heads than tp) gets its gradient summed over the
TP group, one all-reduce each as AOTAutograd derives them (gradsched.tp.collectives.grad_sum's backward):
2 x layers + 1 small collectives a backward for a Llama, each a launch and a synchronisation of the group.
Megatron coalesces them into one flat all-reduce (`_allreduce_layernorm_grads`); this pass does the same
in the graph.

Invariant: after `bucket_tp_grad_sums`, each replicated gradient of `spec.grads` whose sum was a lone TP
all-reduce reaching the output through views only is the matching slice of ONE all-reduce over the TP
group of the concatenation of those gradients' inputs (one such all-reduce per dtype, placed right after
the last of its inputs is computed); the values are the same, element by element, and every other
node is left as it was. passes/verify_tensor_parallel.py proves the result (each replicated gradient
still meets exactly one TP sum, a sharded one none), so this pass runs before it.

Assumes: AOTAutograd's backward graph of a graph passes/tensor_parallel.py split (aten-level ops,
functional collectives with their wait_tensor), and every rank of the group runs the same graph, so
every rank buckets the same gradients in the same order.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .graph_utils import collective_group, collective_kind, fake_mode_of, is_collective, set_fake

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}


@dataclass
class TensorParallelBuckets:
    buckets: list = field(default_factory=list)  # (dtype, [parameter names]) of each all-reduce made


def _sum_of(grad: fx.Node, group: str) -> tuple[fx.Node | None, list]:
    """The TP all-reduce whose result `grad` is, through views that nothing else reads, and those views in
    order (None, [] where it is no such sum)."""
    n, chain = grad, []
    while n.op == "call_function" and n.target in _VIEWS and len(n.users) == 1:
        chain.insert(0, n)
        n = n.args[0]
    if n.op != "call_function" or n.target is not c10d.wait_tensor.default or len(n.users) != 1:
        return None, []
    ar = n.args[0]
    if is_collective(ar) and collective_kind(ar) == "all_reduce" and collective_group(ar) == group \
            and ar.args[1] == "sum" and len(ar.users) == 1:
        return ar, chain
    return None, []


def bucket_tp_grad_sums(gm: fx.GraphModule, spec) -> tuple[fx.GraphModule, TensorParallelBuckets]:
    """The pass (see the module docstring). `spec`: passes.verify_tensor_parallel.TensorParallelGradSpec."""
    record = TensorParallelBuckets()
    outputs = gm.graph.output_node().args[0]
    found = {}  # all-reduce -> (parameter name, the views after it), in gradient order
    for index, (name, replicated) in sorted(spec.grads.items()):
        grad = outputs[index] if index < len(outputs) else None
        ar, chain = _sum_of(grad, spec.group) if replicated and isinstance(grad, fx.Node) else (None, [])
        if ar is not None and ar not in found and len(grad.users) == 1:
            found[ar] = (name, chain)
    by_dtype: dict = {}
    for ar, (name, chain) in found.items():
        by_dtype.setdefault(ar.args[0].meta["val"].dtype, []).append((ar, name, chain))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mode = fake_mode_of(gm)
    for dtype, sums in by_dtype.items():
        if len(sums) < 2:
            continue
        parts = [ar.args[0] for ar, _, _ in sums]
        last = max(parts, key=order.__getitem__)
        with gm.graph.inserting_before(last.next), mode:  # (inserting_after would reverse them)
            flats = []
            for x in parts:
                f = gm.graph.call_function(aten.view.default, (x, [-1]))
                set_fake(f, x.meta["val"].reshape(-1))
                flats.append(f)
            cat = gm.graph.call_function(aten.cat.default, (flats,))
            set_fake(cat, torch.cat([f.meta["val"] for f in flats]))
            ar = gm.graph.call_function(c10d.all_reduce.default, (cat, "sum", spec.group))
            set_fake(ar, torch.empty_like(cat.meta["val"]))
            wait = gm.graph.call_function(c10d.wait_tensor.default, (ar,))
            set_fake(wait, torch.empty_like(cat.meta["val"]))
            sizes = [x.meta["val"].numel() for x in parts]
            split = gm.graph.call_function(aten.split_with_sizes.default, (wait, sizes))
            set_fake(split, list(torch.split(wait.meta["val"], sizes)))
            for i, ((old, _, chain), x) in enumerate(zip(sums, parts)):
                piece = gm.graph.call_function(operator.getitem, (split, i))
                set_fake(piece, split.meta["val"][i])
                shaped = gm.graph.call_function(aten.view.default, (piece, list(x.meta["val"].shape)))
                set_fake(shaped, x.meta["val"].clone())
                (old_wait,) = old.users
                old_wait.replace_all_uses_with(shaped)
                gm.graph.erase_node(old_wait)
                gm.graph.erase_node(old)
                at = shaped
                for view in chain:  # the views that made it the gradient now read the bucket's slice: after it
                    at.append(view)
                    at = view
        record.buckets.append((dtype, [name for _, name, _ in sums]))
    gm.graph.lint()
    gm.recompile()
    return gm, record
