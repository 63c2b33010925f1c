"""Insert the gradient collectives: tied all-reduce, then the bucketed DP reduction.

Invariant established (mode="tied_first", the default): for every tied
gradient, the reduce-scatter (or all-reduce) of the bucket holding it reads the
tied gradient ONLY through the tie group's all-reduce: a data dependence in the
graph, so no scheduler can move the DP reduction ahead of it. The verifier
proves this from reachability.

mode="shard_aligned": reduce-scatter first, then all-reduce over the tie group
only the part of the tied gradient this rank's shard owns (dp x fewer bytes).
Correct only when every tie-group member owns the same element range; the
bucket planner aligns ties for it and the verifier must prove it.

mode="unsafe_rs_first": Megatron-LM #844's order (reduce-scatter, write the
shard back into the bucket, all-reduce the tied weight's full view of the
bucket, keep the owned shard). Wrong when the copies sit at different offsets;
kept so the hazard can be shown and caught.

Assumes: the graph's outputs are gradients (an AOT backward graph, or a flush
graph whose outputs are its gradient inputs), `SyncSpec.grad_outputs` maps
parameter names to output positions, and every rank of a group compiles the
same layout (the cross-rank fingerprint checks it at run time).

After the pass: synced gradients' outputs are None (shard=True) or views of
the all-reduced bucket (shard=False); one extra output per bucket, appended,
holds its reduced shard (or full bucket). With `accumulate`, one input per
synced gradient is appended (gradients of earlier micro-batches), added
before any collective. Collectives are issued in bucket order, tied ones
inside their bucket's block, so every rank issues them in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .bucketing import Bucket, BucketLayout, owned_range
from .graph_utils import META_KEY, GraphBuilder

aten = torch.ops.aten


@dataclass(frozen=True)
class SyncSpec:
    layout: BucketLayout
    grad_outputs: dict[str, int]  # parameter name -> output position holding its gradient
    group: str  # the gradient (data-parallel) group's name
    group_size: int
    shard_rank: int  # this rank's index in the gradient group
    tie_groups: dict[str, str] = field(default_factory=dict)  # tie key -> group name
    mode: str = "tied_first"
    shard: bool = True
    average: bool = True
    accumulate: bool = False


@dataclass
class SyncRecord:
    """What the pass did, for the runtime and the report: left in gm.meta[META_KEY]."""
    spec: SyncSpec
    n_outputs: int  # outputs before the pass
    acc_inputs: list[str]  # parameter names whose accumulated gradient is appended as input
    sources: dict[str, list[str]]  # parameter name -> nodes holding its local gradient (for the verifier)
    results: list[str]  # per bucket, the node holding its reduced shard (or full bucket)


def insert_grad_sync(gm: fx.GraphModule, spec: SyncSpec) -> fx.GraphModule:
    b = GraphBuilder(gm)
    out_node = gm.graph.output_node()
    outputs = list(out_node.args[0])
    grads = {name: outputs[i] for name, i in spec.grad_outputs.items()}
    record = SyncRecord(spec, len(outputs), [], {n: [g.name] for n, g in grads.items()}, [])

    acc = {}
    if spec.accumulate:
        for bucket in spec.layout.buckets:
            for s in bucket.slots:
                ex = torch.empty(s.shape, dtype=s.dtype)
                acc[s.name] = b.placeholder(f"acc_grad_{len(acc)}", ex)
                record.acc_inputs.append(s.name)
                record.sources[s.name].append(acc[s.name].name)

    cursor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    results = []
    for bucket in spec.layout.buckets:
        # a bucket's block starts once its last gradient is ready, and after the
        # previous bucket's block: collectives keep bucket order on every rank
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        anchor = max([grads[s.name] for s in bucket.slots] + [cursor], key=position.__getitem__)
        with gm.graph.inserting_before(anchor.next):  # keeps inserted nodes in creation order
            results.append(_sync_bucket(b, spec, bucket, grads, acc))
        cursor = results[-1]
    record.results = [r.name for r in results]

    for name, i in spec.grad_outputs.items():
        outputs[i] = None
    if not spec.shard:  # all-reduced buckets: hand each parameter its view back
        with gm.graph.inserting_before(out_node):
            for bucket, flat in zip(spec.layout.buckets, results):
                for s in bucket.slots:
                    v = b.call(aten.slice.Tensor, flat, 0, s.offset, s.offset + s.numel)
                    v = b.call(aten.reshape.default, v, list(s.shape))
                    if s.dtype != bucket.dtype:
                        v = b.call(torch.ops.prims.convert_element_type.default, v, s.dtype)
                    outputs[spec.grad_outputs[s.name]] = v
    out_node.args = (tuple(outputs) + tuple(results),)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    gm.meta[META_KEY] = record
    return gm


def _sync_bucket(b: GraphBuilder, spec: SyncSpec, bucket: Bucket, grads, acc) -> fx.Node:
    names = [s.name for s in bucket.slots]
    kind = "reduce_scatter" if spec.shard else "all_reduce"
    dp_tag = {"role": "dp_reduce", "bucket": bucket.index, "params": names, "group": spec.group,
              "group_kind": "grad"}

    def tie_reduce(x, s, role, elems):
        tag = {"role": role, "bucket": bucket.index, "params": [s.name], "group": spec.tie_groups[s.tie],
               "group_kind": f"tie:{s.tie}", "tie": s.tie, "elements": elems}
        return b.collective("all_reduce", x, spec.tie_groups[s.tie], 0, tag)

    parts = []
    for s in bucket.slots:
        g = grads[s.name]
        if s.name in acc:
            g = b.call(aten.add.Tensor, g, acc[s.name])
        g = b.flat(g, bucket.dtype)
        if s.tie and spec.mode == "tied_first":
            g = tie_reduce(g, s, "tie_all_reduce", (0, s.numel))
        parts.append(g)
    pad = bucket.numel - (bucket.slots[-1].offset + bucket.slots[-1].numel)
    if pad:
        parts.append(b.call(aten.zeros.default, [pad], dtype=bucket.dtype, device=parts[0].meta["val"].device))
    flat = b.call(aten.cat.default, parts) if len(parts) > 1 else parts[0]
    if spec.average and spec.group_size > 1:
        flat = b.call(aten.mul.Tensor, flat, 1.0 / spec.group_size)
    out = b.collective(kind, flat, spec.group, spec.group_size, dp_tag)
    if not spec.shard or spec.mode == "tied_first":
        return out

    size = bucket.shard_numel(spec.group_size)
    start = spec.shard_rank * size
    if spec.mode == "shard_aligned":
        for s in bucket.slots:
            if not s.tie:
                continue
            lo, hi = owned_range(bucket.numel, s.offset, s.numel, spec.group_size, spec.shard_rank)
            if lo == hi:
                continue  # aligned layouts: the other members own none of it either
            a, z = s.offset + lo - start, s.offset + hi - start
            piece = tie_reduce(b.call(aten.slice.Tensor, out, 0, a, z), s, "tie_all_reduce_shard", (lo, hi))
            out = b.call(aten.slice_scatter.default, out, piece, 0, a, z)
        return out

    # unsafe_rs_first: the #844 order, on purpose
    buf = b.call(aten.slice_scatter.default, flat, out, 0, start, start + size)
    for s in bucket.slots:
        if s.tie:
            view = b.call(aten.slice.Tensor, buf, 0, s.offset, s.offset + s.numel)
            view = tie_reduce(view, s, "tie_all_reduce", (0, s.numel))
            buf = b.call(aten.slice_scatter.default, buf, view, 0, s.offset, s.offset + s.numel)
    return b.call(aten.slice.Tensor, buf, 0, start, start + size)
