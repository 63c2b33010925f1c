"""Find what mixes tokens along the sequence and that no ring replaces.

Invariant: none; these passes only read. Under context parallelism each rank holds
a slice of the sequence, so anything that mixes tokens and is left as it is would
mix only local tokens: silently wrong. The backend refuses such a graph, naming the
op, the module and the source line:

- `hand_written_attention`: a softmax fed by a matmul (q @ k^T, softmax, @ v);
- `unlowered_sequence_mixing`: flash-attn's ops (the `flash_attn` op namespace:
  Dynamo traces INTO `flash_attn_func` and its autograd.Function, so the call the
  ring lowers never appears, only `flash_attn::_flash_attn_forward` inside an
  `autograd_function_apply` subgraph), scan higher-order ops, and cumulative ops or
  convolutions over a dimension of the local sequence length.

The sequence dimension is recognised by its size: the local sequence length, read
from the token input ([B, S_local] integers). An op over another dimension that
happens to have that size is refused too: an error naming it beats a silent wrong
answer, and the message says how to tell them apart (cp=1 trains it).

Assumes a Dynamo (torch-level) graph, before AOTAutograd: softmax appears as
torch.softmax, F.softmax or the Tensor.softmax method, matmuls as
matmul/bmm/einsum/@; subgraphs of higher-order ops are submodules of the graph.
"""
from __future__ import annotations

import operator
import os

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


_CUMULATIVE = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
_CONV = {"conv1d", "conv2d", "convolution", "_convolution", "conv_transpose1d"}
_SCANS = {"scan", "associative_scan"}


def _name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


def _namespace(node: fx.Node) -> str | None:
    t = node.target
    ns = getattr(t, "namespace", None)  # OpOverload / OpOverloadPacket
    if ns is None and isinstance(getattr(t, "_schema", None), torch._C.FunctionSchema):
        ns = t._schema.name.split("::")[0]
    return ns


def _value(node) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def _dim_arg(node: fx.Node, position: int):
    if "dim" in node.kwargs:
        return node.kwargs["dim"]
    args = node.args[1:] if node.op == "call_method" else node.args
    return args[position - (1 if node.op == "call_method" else 0)] if len(args) > position - (
        1 if node.op == "call_method" else 0) else None


def _mixes_sequence(node: fx.Node, seq_len: int | None) -> str | None:
    name = _name(node).split(".")[-1] if node.op != "call_method" else node.target
    base = name.split(".")[0]
    if _namespace(node) == "flash_attn" or "flash_attn" in str(node.target):
        return "flash-attn attention (flash_attn_func and its kin are not lowered into the ring)"
    if base in _SCANS or any(s in str(node.target) for s in ("higher_order.scan", "associative_scan")):
        return "a scan over the sequence"
    if seq_len is None or node.op not in ("call_function", "call_method"):
        return None
    x = _value(node.args[0]) if node.args else None
    if x is None:
        return None
    if base in _CUMULATIVE:
        dim = _dim_arg(node, 1)
        if isinstance(dim, int) and x.dim() and x.shape[dim % x.dim()] == seq_len:
            return f"{base} along a dimension of the local sequence length ({seq_len})"
    if base in _CONV and x.dim() >= 3 and x.shape[-1] == seq_len:
        return f"{base} over a dimension of the local sequence length ({seq_len})"
    return None


def _where(node: fx.Node) -> str:
    """The call's source lines, innermost first (the op may sit inside a library the model calls)."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").strip().splitlines()]
    frames = [f"{lines[i]}: {lines[i + 1]}" if i + 1 < len(lines) else lines[i]
              for i, line in enumerate(lines) if line.startswith("File ")]
    frames = [f for f in frames if f"{os.sep}torch{os.sep}" not in f]  # torch's own frames say nothing
    return " <- ".join(reversed(frames[-3:])) or "unknown line"


def _reaches_output(graph: fx.Graph) -> set:
    """Nodes whose value reaches the graph's output."""
    live, todo = set(), [graph.output_node()]
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)
    return live


def unlowered_sequence_mixing(gm: fx.GraphModule, seq_len: int | None) -> list[str]:
    """'what, node in module at line' for every op left in gm (or its subgraphs) that mixes tokens
    along the sequence; seq_len: the local sequence length, or None if unknown."""
    found = []
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        live = _reaches_output(sub.graph)
        for n in sub.graph.nodes:
            if n not in live:
                continue  # its value is never used (HF computes a packed-sequence mask it may drop)
            what = _mixes_sequence(n, seq_len)
            if what:
                found.append(f"{what}: {n.name} in module '{module_of(n)}' at {_where(n)}")
    return found
