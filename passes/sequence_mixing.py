"""Find attention written by hand (a softmax fed by a matmul), which no ring can replace.

Invariant: none; this pass only reads. Under context parallelism each rank holds
a slice of the sequence, so a hand-written attention (q @ k^T, softmax, @ v)
would attend only to local tokens: silently wrong. The backend refuses such a
graph with the module's name instead.

Assumes a Dynamo (torch-level) graph: softmax appears as torch.softmax,
F.softmax or the Tensor.softmax method, matmuls as matmul/bmm/einsum/@.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.log_softmax,
            torch.ops.aten._softmax.default, torch.ops.aten.softmax.int}
_MATMUL = {torch.matmul, torch.bmm, torch.einsum, operator.matmul, torch.ops.aten.bmm.default,
           torch.ops.aten.mm.default, torch.ops.aten.matmul.default}
_HOPS = 4  # softmax(scale * mask(q @ k^T)): a few elementwise steps at most


def _is(node: fx.Node, targets: set, methods: tuple) -> bool:
    return (node.op == "call_function" and node.target in targets) or \
        (node.op == "call_method" and node.target in methods)


def _fed_by_matmul(node: fx.Node) -> bool:
    frontier = list(node.all_input_nodes)
    for _ in range(_HOPS):
        if any(_is(n, _MATMUL, ("matmul", "bmm", "__matmul__")) for n in frontier):
            return True
        frontier = [a for n in frontier for a in n.all_input_nodes]
    return False


def module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else "<top level>"


def hand_written_attention(gm: fx.GraphModule) -> list[str]:
    """'node in module' for every softmax fed by a matmul."""
    return [f"{n.name} in module '{module_of(n)}'" for n in gm.graph.nodes
            if _is(n, _SOFTMAX, ("softmax", "log_softmax")) and _fed_by_matmul(n)]
