"""Find what mixes tokens along the sequence and that no ring replaces.

Invariant: none; these passes only read. Under context parallelism each rank holds
a slice of the sequence, so anything that mixes tokens and is left as it is would
mix only local tokens: silently wrong. The backend refuses such a graph, naming the
op, the module and the source line:

- `hand_written_attention`: a softmax (log_softmax, logsumexp, a sum) of token-pair scores,
  found by dataflow: any chain of elementwise and shape ops from a product of two
  sequence-dependent values (q @ k^T) to the normalisation, in every subgraph;
- `unlowered_sequence_mixing`: flash-attn's ops (the `flash_attn` op namespace:
  Dynamo traces INTO `flash_attn_func` and its autograd.Function, so the call the
  ring lowers never appears, only `flash_attn::_flash_attn_forward` inside an
  `autograd_function_apply` subgraph), scan higher-order ops, and cumulative ops or
  convolutions over a dimension of the local sequence length.

The sequence dimension is recognised by its size: the local sequence length, read
from the token input ([B, S_local] integers). An op over another dimension that
happens to have that size is refused too: an error naming it beats a silent wrong
answer, and the message says how to tell them apart (cp=1 trains it).

Assumes a Dynamo (torch-level) graph, before AOTAutograd (aten spellings are known too):
softmax appears as torch.softmax, F.softmax or the Tensor.softmax method, products as
matmul/bmm/einsum/baddbmm/linear/@; subgraphs of higher-order ops are submodules of the
graph, named by get_attr arguments of the op's call.
"""
from __future__ import annotations

import operator
import os

import torch
import torch.fx as fx

from .graph_utils import fake_value, stack_frames

_ATEN = torch.ops.aten
# Normalisations over the key axis: what turns token-pair scores into attention weights (a sum covers
# a hand-written exp(s) / exp(s).sum(-1), and its logsumexp)
_NORMALISE = {torch.softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.log_softmax,
              torch.nn.functional.softmin, torch.special.softmax, torch.special.log_softmax, torch.logsumexp,
              torch.special.logsumexp, torch.sum, _ATEN._softmax.default, _ATEN.softmax.int,
              _ATEN._log_softmax.default, _ATEN.log_softmax.int, _ATEN.logsumexp.default, _ATEN.sum.dim_IntList}
_NORMALISE_METHODS = ("softmax", "log_softmax", "logsumexp", "sum")
# Products and which of their arguments are the two factors (baddbmm / addmm add their first argument)
_PRODUCTS = {torch.matmul: (0, 1), operator.matmul: (0, 1), torch.bmm: (0, 1), torch.mm: (0, 1),
             torch.nn.functional.linear: (0, 1), torch.baddbmm: (1, 2), torch.addmm: (1, 2),
             _ATEN.mm.default: (0, 1), _ATEN.bmm.default: (0, 1), _ATEN.matmul.default: (0, 1),
             _ATEN.baddbmm.default: (1, 2), _ATEN.addmm.default: (1, 2)}
_PRODUCT_METHODS = {"matmul": (0, 1), "__matmul__": (0, 1), "bmm": (0, 1), "mm": (0, 1), "baddbmm": (1, 2),
                    "addmm": (1, 2)}
_EINSUM = {torch.einsum, _ATEN.einsum.default}


def _is(node: fx.Node, targets: set, methods: tuple) -> bool:
    return (node.op == "call_function" and node.target in targets) or \
        (node.op == "call_method" and node.target in methods)


def _factors(node: fx.Node) -> list | None:
    """The factors of a product (matmul, bmm, einsum, linear, baddbmm, ...); None for any other op."""
    if node.op == "call_function" and node.target in _EINSUM:
        return [a for a in node.all_input_nodes]
    positions = (_PRODUCTS.get(node.target) if node.op == "call_function" else
                 _PRODUCT_METHODS.get(node.target) if node.op == "call_method" else None)
    if positions is None:
        return None
    return [node.args[i] for i in positions if i < len(node.args)]


def _carries_sequence(placeholder: fx.Node) -> bool:
    """A graph input that is no module state: tokens, positions, hidden states, masks. Dynamo marks a
    parameter's or buffer's input static (meta["tensor_dict"]), a parameter's fake value `_is_param`, and
    names lifted ones by their source; a buffer such as RoPE's inv_freq carries no sequence."""
    v = fake_value(placeholder)
    static = (placeholder.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")
    return v is not None and not static and not getattr(v, "_is_param", False) and \
        not any(s in placeholder.name for s in ("_parameters_", "_buffers_"))


def _same(a, b) -> bool:
    return str(a) == str(b)  # ints and symbolic sizes alike, without guarding on a symbolic one


def _pairs_tokens(node: fx.Node, factors: list, sequence: set, seq_len: int | None) -> bool:
    """A product of two sequence-dependent values whose result is square in its last two axes: token
    pairs ([.., L, L], q @ k^T) or, contracting over the sequence, feature pairs ([.., D, D], as in
    cross-covariance attention): either way it mixes tokens. With seq_len known, the local sequence
    length must also appear in the last two axes of the result or of a factor."""
    if len(factors) < 2 or not all(isinstance(f, fx.Node) and f in sequence for f in factors):
        return False
    out = fake_value(node)
    if out is None or out.dim() < 2 or not _same(out.shape[-1], out.shape[-2]):
        return False
    if seq_len is None:
        return True
    axes = [d for t in [out] + [fake_value(f) for f in factors] if t is not None for d in t.shape[-2:]]
    return any(_same(d, seq_len) for d in axes)


def module_of(node: fx.Node) -> str:
    """The innermost module the node's op was called in, by its path in the model ('layers.0.attn')."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return path.removeprefix("L['self']").removeprefix(".") or "<top level>"  # Dynamo's name for the model


def hand_written_attention(gm: fx.GraphModule, seq_len: int | None = None) -> list[str]:
    """'op node over the scores of product node in module at line' for every normalisation over keys (softmax,
    log_softmax, logsumexp, a sum) of token-pair scores, in gm and in the subgraphs of its higher-order
    ops (activation checkpointing, wrap, autograd.Function, ...) at any depth.

    Found by dataflow, not by distance: scores are the result of a product of two sequence-dependent
    values that is square in its last two axes (`_pairs_tokens`; q @ k^T, einsum, bmm, baddbmm,
    F.linear(q, k)), and every value computed from scores by ops other than a product (any chain of
    casts, scales, soft-capping, biases and masks added, where / masked_fill, views, transposes,
    dropout) is scores too. A product that is not itself token pairs stops the chain (P @ V, a
    classifier's `h @ W`). Sequence-dependent: computed from a graph input that is no parameter or
    buffer (`_carries_sequence`); a subgraph's inputs are the higher-order op's operands, taken in
    order (where their number differs, each input is judged by itself). seq_len: the local sequence
    length, if known (see `_pairs_tokens`). Each finding is listed once, however often its subgraph
    is called.

    Assumes a Dynamo (torch-level) or aten graph whose nodes carry example values
    (meta["example_value"] or meta["val"]): a product without one is not recognised."""
    found, seen = [], set()
    _scan_for_attention(gm, None, seq_len, found, seen)
    for sub in gm.modules():  # bodies no call of a higher-order op names: inputs judged by themselves
        if isinstance(sub, fx.GraphModule) and id(sub) not in seen:
            _scan_for_attention(sub, None, seq_len, found, seen)
    return list(dict.fromkeys(found))


def _scan_for_attention(gm: fx.GraphModule, inputs: list | None, seq_len: int | None, found: list,
                        seen: set) -> fx.Node | None:
    """Scan one graph, appending to found. inputs: per placeholder, (carries the sequence, the product its
    scores come from or None), from the caller's operands; None: judge each input by itself. Returns the
    product whose scores reach gm's output, or None."""
    seen.add(id(gm))
    sequence, scores = set(), {}  # scores: node -> the token-pair product it is computed from
    placeholders = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            carries, origin = inputs[placeholders] if inputs else (_carries_sequence(n), None)
            placeholders += 1
            sequence.update([n] if carries else [])
            scores.update({n: origin} if origin is not None else {})
            continue
        ins = n.all_input_nodes
        if any(a in sequence for a in ins):
            sequence.add(n)
        factors = _factors(n)
        if factors is not None:
            if _pairs_tokens(n, factors, sequence, seq_len):
                scores[n] = n
            continue  # any other product ends the chain
        origin = _through_bodies(gm, n, sequence, scores, seq_len, found, seen)
        origin = origin or next((scores[a] for a in ins if a in scores), None)
        if origin is None:
            continue
        scores[n] = origin
        if _is(n, _NORMALISE, _NORMALISE_METHODS):
            found.append(f"{_name(n)} '{n.name}' over the scores of {_name(origin)} '{origin.name}' "
                         f"in module '{module_of(n)}' at {_where(n)}")
    return scores.get(gm.graph.output_node())


def _through_bodies(gm: fx.GraphModule, node: fx.Node, sequence: set, scores: dict, seq_len, found, seen):
    """Scan the subgraphs a higher-order op's call runs (its arguments naming GraphModules), their inputs
    being its other operands in order; the product whose scores reach a body's output, or None."""
    flat = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: flat.append(a) or a)
    is_body = [a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule) for a in flat]
    operands = [a for a, body in zip(flat, is_body) if not body]
    origins = []
    for body in (getattr(gm, a.target) for a, b in zip(flat, is_body) if b):
        placeholders = body.graph.find_nodes(op="placeholder")
        inputs = [(o in sequence, scores.get(o)) for o in operands] if len(operands) == len(placeholders) else None
        origins.append(_scan_for_attention(body, inputs, seq_len, found, seen))
    return next((o for o in origins if o is not None), None)


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
    x = fake_value(node.args[0]) if node.args else None
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
    frames = [f"{frame}: {code}" if code else frame for frame, code in stack_frames(node.meta.get("stack_trace"))]
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
