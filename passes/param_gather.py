"""Parameters as shards: each bucket's parameters are all-gathered in the graph just before use.

Invariant established: no use of a parameter placeholder named in the spec is left, except (with
`keep_placeholders_in_output`) as a graph output; each use reads a view of its bucket's gathered
buffer instead, `gathered[offset:offset + numel].view(shape)`. A new placeholder per bucket used,
appended after the existing ones in first-use order (`GatherRecord.buckets`), is this rank's
shard; one all-gather per bucket, over the data-parallel group, rebuilds the bucket.

Prefetch, one bucket ahead: bucket k+1's gather reads its shard through a zero made from the
first value computed from bucket k past its views and past a node of several outputs (a split: its first
getitem) (x - 0.0, bit for bit; from bucket k's gathered buffer when one node is the first use of both, or
when nothing computed follows), so no scheduler can issue it earlier,
and at most two buckets are gathered ahead of their use; bucket 0's is issued first. A gathered
buffer dies after its last use in the graph (Inductor frees it then); `GatherRecord.kept` names
the graph outputs that keep one alive past the graph (a forward graph saving a parameter's view
for the backward, where `keep_placeholders_in_output` did not apply).

Assumes: the named placeholders hold whole parameters that nothing mutates; each bucket's slots
(offset, numel, shape) are those of `BucketLayout`, and every rank of the group calls the pass
with the same spec (the gathers are then the same everywhere). `meta["val"]` is set on every new
node. Graphs without a parameter named in the spec are unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .grad_ready_order import GradSpec
from .graph_utils import GraphBuilder, c10d

aten = torch.ops.aten


@dataclass(frozen=True)
class ParamSlot:
    bucket: int
    offset: int
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype  # the parameter's


@dataclass(frozen=True)
class GatherSpec:
    params: dict  # placeholder name -> ParamSlot
    shard_numel: dict  # bucket index -> elements of each rank's shard
    shard_dtype: dict  # bucket index -> the shards' dtype (what is gathered)
    group: str  # the data-parallel group's name
    group_size: int
    keep_placeholders_in_output: bool = False  # forward graphs: the backward gathers again


@dataclass(frozen=True)
class GatherRecord:
    buckets: tuple[int, ...]  # bucket of each appended shard placeholder, in order
    kept: tuple[str, ...]  # graph outputs that keep a gathered buffer alive


def gather_params(gm: fx.GraphModule, spec: GatherSpec) -> tuple[fx.GraphModule, GatherRecord]:
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and n.name in spec.params}
    if not phs:
        return gm, GatherRecord((), ())
    _sink_views(gm, set(phs.values()))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = gm.graph.output_node()

    def first_use(ph):
        users = [u for u in ph.users if u is not out]
        return min((order[u] for u in users), default=len(order))
    by_bucket: dict[int, list] = {}
    for ph in sorted(phs.values(), key=first_use):
        by_bucket.setdefault(spec.params[ph.name].bucket, []).append(ph)
    buckets = list(by_bucket)  # in first-use order
    b = GraphBuilder(gm)
    device = next(iter(phs.values())).meta["val"].device
    shards = [b.placeholder(f"param_shard_{k}", [spec.shard_numel[k]], spec.shard_dtype[k], device)
              for k in buckets]
    previous = None  # (the first use of the previous bucket, its gathered buffer)
    gathered_nodes = set()
    for k, shard in zip(buckets, shards):
        first = min((u for ph in by_bucket[k] for u in ph.users if u is not out), key=order.__getitem__,
                    default=None)
        if first is None:  # only outputs use it (kept placeholders): nothing to gather
            continue
        with gm.graph.inserting_before(first):
            src = shard
            if previous is not None:  # one bucket ahead, not more
                # the previous bucket's first use, or (one node reads both buckets) its gathered buffer
                before = previous[0] if previous[0] in order and order[previous[0]] < order[first] else previous[1]
                src = b.after(shard, before)
            gathered = b.call(c10d.wait_tensor.default, b.call(
                c10d.all_gather_into_tensor.default, src, spec.group_size, spec.group))
            gathered_nodes.add(gathered)
            for ph in by_bucket[k]:
                s = spec.params[ph.name]
                view = b.call(aten.view.default, b.call(aten.slice.Tensor, gathered, 0, s.offset, s.offset + s.numel),
                              list(s.shape))
                if view.meta["val"].dtype != s.dtype:
                    view = b.call(torch.ops.prims.convert_element_type.default, view, s.dtype)
                ph.replace_all_uses_with(view, delete_user_cb=lambda u: u is not out or not spec.keep_placeholders_in_output)
        use = _computed_from(first, order)
        previous = (use if isinstance(use.meta.get("val"), torch.Tensor) else gathered, gathered)
    kept = tuple(str(a) for a in out.args[0] if _aliases_a_gather(a, gathered_nodes))
    gm.graph.lint()
    gm.recompile()
    return gm, GatherRecord(tuple(buckets), kept)


def expected_ready_order(gm: fx.GraphModule, params: dict) -> list[GradSpec]:
    """Reads only. The order the backward is expected to produce the gradients of the parameters a
    forward graph reads (`params`: placeholder name -> (name, shape, dtype)): the reverse of their
    first use, since the backward runs the forward's uses last to first. Unused ones come last."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = gm.graph.output_node()
    first = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in params:
            first[n.name] = min((order[u] for u in n.users if u is not out), default=-1)
    return [GradSpec(name, tuple(shape), dtype, -1) for ph, (name, shape, dtype) in
            sorted(params.items(), key=lambda kv: -first.get(kv[0], -1))]


_VIEWS = {aten.view.default, aten.slice.Tensor, aten.t.default, aten.permute.default, aten.transpose.int,
          aten.reshape.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default,
          aten._unsafe_view.default}


def _computed_from(node: fx.Node, order: dict) -> fx.Node:
    """The first node past `node`'s chain of views (a view is no use: the next bucket would be
    gathered as soon as this one arrives), and past a node giving several tensors (a split: its first
    getitem), so that the result is a tensor when one follows."""
    while node.op == "call_function" and (node.target in _VIEWS or not isinstance(node.meta.get("val"), torch.Tensor)):
        users = [u for u in node.users if u in order and u.op != "output"]
        if not users:
            break
        node = min(users, key=order.__getitem__)
    return node


def _sink_views(gm: fx.GraphModule, params: set) -> None:
    """Move each view of a parameter (a chain of view ops) to just before its first user. AOTAutograd's
    backward computes the transposes of every weight at its top: left there, they would make every
    bucket's first use the graph's start, and every bucket would be gathered at once."""
    out = gm.graph.output_node()
    views = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _VIEWS and _is_param_view(n, params)]
    for n in reversed(views):  # users first: a view of a view has moved already
        order = {m: i for i, m in enumerate(gm.graph.nodes)}
        first = min((u for u in n.users), key=order.__getitem__, default=None)
        if first is not None and first is not out and first is not n.next:
            first.prepend(n)


def _is_param_view(n: fx.Node, params: set) -> bool:
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS:
        n = n.args[0]
    return n in params


def _aliases_a_gather(node: fx.Node, gathered: set) -> bool:
    """Whether node is a view (through view ops only) of a gathered bucket: saved, it keeps the bucket alive."""
    while isinstance(node, fx.Node):
        if node in gathered:
            return True
        if node.op != "call_function" or node.target not in _VIEWS:
            return False
        node = node.args[0]
    return False
