"""Which linear is which under tensor parallelism, found by dataflow on the Dynamo graph.

Invariant: none; these functions only read the graph. `find_roles` names each linear and embedding
node's role for passes/tensor_parallel.py: "column" (an attention call's q/k/v projections, an MLP's
first linears), "row" (the projection after attention or an MLP), "head" (a linear left over whose
output is a graph output or the cross-entropy's logits), "vocab" (the embedding over the head's
vocabulary, the head's own weight when tied; in a graph with no head, a pipeline's first stage, the
embedding of a token input) and "replicated" (a key/value projection with fewer
heads than tp: each rank then takes the heads its queries read). Any other linear is replicated.

Assumes a Dynamo (torch-level) graph: linears as F.linear or torch.addmm(bias, x, weight) with a
parameter weight (GPT-2's Conv1D), attention as F.scaled_dot_product_attention.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import fake_value, stack_frames
from .tp_layouts import TensorParallelError, normalize_dim

LINEAR = {torch._C._nn.linear, F.linear}
EMBEDDING = {F.embedding}
SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
NORMS = {F.layer_norm, F.rms_norm}
POINTWISE = {operator.add, operator.mul, operator.sub, operator.truediv, operator.neg, operator.pow,
              torch.add, torch.mul, torch.sub, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt,
              torch.exp, torch.tanh, torch.sigmoid, torch.erf, F.gelu, F.silu, F.relu, F.dropout, torch.where,
              torch.detach}
POINTWISE_METHODS = {"to", "float", "half", "bfloat16", "double", "type_as", "pow", "rsqrt", "sqrt", "neg",
                      "exp", "tanh", "sigmoid", "add", "mul", "sub", "div", "clone", "contiguous", "__mul__",
                      "__add__", "__sub__", "__truediv__", "detach"}
VIEWS = {"view", "reshape"}
REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "norm", "softmax", "log_softmax"}


def is_param(n: fx.Node) -> bool:
    v = fake_value(n)
    return n.op == "placeholder" and v is not None and (
        getattr(v, "is_param", False) or "_parameters_" in n.name)


def is_op(n, fns=(), methods=()) -> bool:
    return isinstance(n, fx.Node) and ((n.op == "call_function" and n.target in fns) or
                                       (n.op == "call_method" and n.target in methods))


def is_sdpa(n) -> bool:
    """F.scaled_dot_product_attention, or a function standing in for it that says so (computes_sdpa: the same
    arguments and results, e.g. the dry run's device-priced kernels)."""
    return is_op(n, SDPA) or (isinstance(n, fx.Node) and n.op == "call_function"
                              and getattr(n.target, "computes_sdpa", False))


def is_linear(n) -> bool:
    """F.linear(x, w, b), or torch.addmm(b, x, w) with a parameter w (GPT-2's Conv1D)."""
    return is_op(n, LINEAR) or (is_op(n, (torch.addmm,)) and len(n.args) == 3 and is_param(n.args[2]))


def linear_parts(n: fx.Node):
    """(x, weight, bias, the weight's output-feature dimension) of a linear in either spelling."""
    if n.target is torch.addmm:
        return n.args[1], n.args[2], n.args[0], 1
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return n.args[0], n.args[1], b, 0


def set_linear_parts(n: fx.Node, x, w, b) -> None:
    if n.target is torch.addmm:
        n.target, n.args = (torch.addmm, (b, x, w)) if b is not None else (torch.mm, (x, w))
    else:
        n.args = (x, w, b)
    n.kwargs = {}


def is_pointwise(n) -> bool:
    return is_op(n, POINTWISE, POINTWISE_METHODS)


def linears_above(x: fx.Node) -> set:
    """The linears whose outputs reach `x` through anything but another linear or attention."""
    found, todo, seen = set(), [x], set()
    while todo:
        n = todo.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if is_linear(n):
            found.add(n)
        elif not is_sdpa(n) and n.op != "placeholder":
            todo.extend(n.all_input_nodes)
    return found


def linear_below(n: fx.Node) -> fx.Node | None:
    """The one linear that reads `n` through shape ops only (an attention call's output projection)."""
    users = list(n.users)
    if len(users) != 1:
        return None
    u = users[0]
    if is_linear(u) and linear_parts(u)[0] is n:
        return u
    if is_op(u, (torch.reshape, torch.transpose, torch.flatten),
           VIEWS | {"transpose", "contiguous", "flatten", "permute"}):
        return linear_below(u)
    return None


def pointwise_cone(x: fx.Node) -> set | None:
    """The linears that `x` is a pointwise function of, with nothing else (no other tensor) in between."""
    found, todo, seen = set(), [x], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_linear(n):
            found.add(n)
        elif is_pointwise(n) or is_op(n, (torch.reshape,), VIEWS):
            todo.extend(n.all_input_nodes)
        else:
            return None
    return found or None


def segments_of(lin: fx.Node) -> int:
    """A fused projection's blocks: the pieces its output is split into along the features."""
    users, nd = list(lin.users), fake_value(lin).dim()
    while len(users) == 1 and is_op(users[0], (torch.reshape,), VIEWS) and \
            fake_value(users[0]).shape[-1] == fake_value(lin).shape[-1]:  # GPT-2's Conv1D views its output
        users, nd = list(users[0].users), fake_value(users[0]).dim()
    if len(users) == 1 and is_op(users[0], (torch.split,), {"split", "chunk"}):
        u = users[0]
        pieces = [p.shape[-1] for p in u.meta["example_value"]]
        if normalize_dim(u.kwargs.get("dim", u.args[2] if len(u.args) > 2 else 0), nd) == nd - 1 and \
                len(set(pieces)) == 1:  # equal blocks only: unequal ones (fused GQA q, k, v) are refused at the split
            return len(pieces)
    return 1


def find_roles(graph: fx.Graph, params: dict, tp: int, heads: bool = True) -> dict:
    """Linear and embedding node -> "column" | "row" | "head" | "vocab" | "replicated" (the others:
    replicated). A key/value projection with fewer heads than tp can split stays replicated: each rank
    then takes the heads its queries read (GQA)."""
    roles = {}
    for att in [n for n in graph.nodes if is_sdpa(n)]:
        head_dim = fake_value(att.args[0]).shape[-1]
        for x in att.args[:3]:
            for lin in linears_above(x):
                heads = fake_value(lin).shape[-1] // (head_dim * segments_of(lin))
                if x is att.args[0] or heads % tp == 0:
                    roles[lin] = "column"  # the queries' projection always splits (a fused one with them)
                else:
                    roles.setdefault(lin, "replicated")
        out = linear_below(att)
        if out is None:
            raise TensorParallelError(f"the output of the attention at {where(att)} is read by something other "
                                      "than one projection: heads split over tp would be mixed there.")
        roles[out] = "row"
    for lin in [n for n in graph.nodes if is_linear(n) and n not in roles]:
        cone = pointwise_cone(linear_parts(lin)[0])
        if cone and not any(c in roles for c in cone):
            roles[lin] = "row"
            roles.update({c: "column" for c in cone})
    outputs, memo = set(graph.output_node().all_input_nodes), {}
    if not heads:  # a higher-order op's body: its outputs are not the model's
        return roles
    heads = [n for n in graph.nodes if is_linear(n) and n not in roles and reaches(n, outputs, memo)]
    embeddings = [n for n in graph.nodes if is_op(n, EMBEDDING)]
    for head in heads:
        roles[head] = "head"
        tied = [e for e in embeddings if e.args[1] is linear_parts(head)[1]]
        # untied: the embedding of the graph's own token input over as many rows as the head has outputs
        vocab = fake_value(head).shape[-1]
        for emb in tied or [e for e in embeddings if of_input(e.args[0]) and
                            fake_value(e.args[1]).shape[0] == vocab]:
            roles[emb] = "vocab"
    if not heads:  # a pipeline's first stage: its embedding of the token input is vocab-parallel all the same,
        # so that a tie with the last stage's column-parallel head pairs the same vocabulary rows on each TP rank
        for emb in embeddings:
            if of_input(emb.args[0]) and fake_value(emb.args[1]).shape[0] % tp == 0:
                roles[emb] = "vocab"
    return roles


def of_input(n: fx.Node) -> bool:
    """`n` is a graph input, or one input's copy or view (gradsched.hf.CausalLM clones its tokens first)."""
    while n.op != "placeholder":
        inputs = n.all_input_nodes
        if n.op not in ("call_function", "call_method") or len(inputs) != 1 or n.args[0] is not inputs[0]:
            return False
        n = inputs[0]
    return True


def reaches(n: fx.Node, outputs: set, memo: dict) -> bool:
    """`n` is a graph output or the cross-entropy's logits, or reaches one through shape and pointwise ops."""
    if n not in memo:
        memo[n] = False
        memo[n] = n in outputs or any(is_op(u, (F.cross_entropy,)) and u.args[0] is n for u in n.users) or any(
            (is_pointwise(u) or is_op(u, (torch.flatten, torch.reshape), VIEWS | {"flatten", "contiguous"})
             or u.target is operator.getitem)
            and reaches(u, outputs, memo) for u in n.users)
    return memo[n]


def where(node: fx.Node) -> str:
    frames = stack_frames(node.meta.get("stack_trace"))
    return f"{frames[-1][0]} ({frames[-1][1]})" if frames else f"node {node.name}"


def override_roles(roles: dict, graph: fx.Graph, plan: dict, name_of: dict | None = None) -> dict:
    """`roles` (find_roles') with the user's overrides: `plan` maps a weight's placeholder name (`name_of`: a body's
    placeholder -> the outer graph's name) to "column", "row" or "replicated"; the linear or embedding reading that
    weight takes it ("replicated": no role, whole on every rank). What the overrides make inconsistent (a row that
    reads no column's output, a column or row embedding) is refused by the rewrite, naming the line."""
    if not plan:
        return roles
    for n in graph.nodes:
        if not (is_linear(n) or is_op(n, EMBEDDING)):
            continue
        w = linear_parts(n)[1] if is_linear(n) else n.args[1]
        role = plan.get((name_of or {}).get(w, getattr(w, "name", None))) if isinstance(w, fx.Node) else None
        if role is None:
            continue
        if role != "replicated" and not is_linear(n):
            raise TensorParallelError(f"tp_plan makes the embedding at {where(n)} {role}-parallel: an embedding is "
                                      "vocab-parallel (found) or replicated.")
        if role == "replicated":
            roles.pop(n, None)
        else:
            roles[n] = role
    return roles
