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

Memory (shard=True): one reduce-scatter in flight (not with spec.chain=False: an early graph, whose
reductions are waited for outside it, passes/defer_waits.py, their inputs alive until then). Bucket k+1's reduce-scatter reads its input
through a zero made from bucket k's reduced shard (x - 0.0, bit for bit), so bucket k's wait comes first in every
schedule and its input, the bucket's whole gradients, is freed before bucket k+1's are reduced
(Inductor keeps a collective's input alive until its wait: with every wait at the graph's end, all
of a stage's whole gradients were alive at once). The backward keeps computing while one bucket
is reduced, as FSDP2 does.

With spread_nonfinite (shard=True; the runtime's choice, gradsched.sync.sync_plan): a bucket holding a non-finite
element goes NaN throughout before its reduce-scatter, so every rank's shard of it is NaN: each rank's own shards
tell whether any rank's gradients went non-finite (a sum of finite values that overflows shows on one shard
only: the runtime does not ask for it with fp16 buckets).

After the pass: synced gradients' outputs are None (shard=True) or views of
the all-reduced bucket (shard=False); one extra output per bucket, appended,
holds its reduced shard (or full bucket). With `accumulate`, one input per
synced gradient is appended (gradients of earlier micro-batches), added
before any collective.

A gradient group of one rank issues no reduction: each bucket's result is the bucket (not under
unsafe_rs_first, whose hazard is the reduce-scatter's).

Order (every rank of a group issues the same collectives in the same order, matched
by identity): data-parallel reductions in bucket order (one layout per stage); tie
all-reduces in tie-key order on every member, whatever order the gradients become
ready in (tied_first: before the buckets; the other modes: after them). Each
collective's tag carries its identity (the tie key, or the bucket's slot list) for
the cross-rank fingerprint and the verifier.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .bucketing import Bucket, BucketLayout, owned_range
from .graph_utils import GraphBuilder

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
    # one reduce-scatter in flight (each bucket's reads the previous one's shard): False for a graph whose
    # reductions are waited for outside it (passes/defer_waits.py), which must not wait between buckets
    chain: bool = True
    # a bucket with a non-finite element goes NaN throughout before its reduction (`_spread_nonfinite`): every
    # rank's reduced shard then says whether any rank's gradients went non-finite
    spread_nonfinite: bool = False


@dataclass
class SyncRecord:
    """What the pass did, returned with the graph: the runtime feeds inputs and reads results by it."""
    spec: SyncSpec
    n_outputs: int  # outputs before the pass
    acc_inputs: list[str]  # parameter names whose accumulated gradient is appended as input
    sources: dict[str, list[str]]  # parameter name -> nodes holding its local gradient (for the verifier)
    results: list[str]  # per bucket, the node holding its reduced shard (or full bucket)


def insert_grad_sync(gm: fx.GraphModule, spec: SyncSpec) -> tuple[fx.GraphModule, SyncRecord]:
    b = GraphBuilder(gm)
    out_node = gm.graph.output_node()
    outputs = list(out_node.args[0])
    grads = {name: outputs[i] for name, i in spec.grad_outputs.items()}
    record = SyncRecord(spec, len(outputs), [], {n: [g.name] for n, g in grads.items()}, [])

    acc = {}
    if spec.accumulate:
        for bucket in spec.layout.buckets:
            for s in bucket.slots:
                # on the gradient's own device (the graph's), never a default one
                acc[s.name] = b.placeholder(f"acc_grad_{len(acc)}", s.shape, s.dtype,
                                            grads[s.name].meta["val"].device)
                record.acc_inputs.append(s.name)
                record.sources[s.name].append(acc[s.name].name)

    position = lambda: {n: i for i, n in enumerate(gm.graph.nodes)}  # noqa: E731
    cursor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    slots = [s for bucket in spec.layout.buckets for s in bucket.slots]
    # NOTE: tie collectives go in ONE order on every member: sorted by tie key, never by
    # this stage's ready order (two ties between one stage pair come ready in opposite
    # orders on the two stages; matched by position they would sum unrelated tensors).
    tied = sorted((s for s in slots if s.tie), key=lambda s: s.tie)
    local = {}  # parameter name -> its local gradient, flat, in the bucket's dtype
    if spec.mode == "tied_first":
        for s in tied:  # each tie all-reduce once its gradient is ready and the previous one issued
            pos = position()
            anchor = max([grads[s.name], cursor], key=pos.__getitem__)
            with gm.graph.inserting_before(anchor.next):
                local[s.name] = _tie_reduce(b, spec, _local_grad(b, spec, s, grads, acc), s, "tie_all_reduce",
                                            (0, s.numel))
            cursor = local[s.name]

    results = []
    for bucket in spec.layout.buckets:
        # a bucket's block starts once its last gradient is ready, and after the
        # previous bucket's block: collectives keep bucket order on every rank
        pos = position()
        anchor = max([local.get(s.name, grads[s.name]) for s in bucket.slots] + [cursor], key=pos.__getitem__)
        with gm.graph.inserting_before(anchor.next):  # keeps inserted nodes in creation order
            previous = results[-1] if spec.shard and spec.chain and results else None
            results.append(_reduce_bucket(b, spec, bucket, grads, acc, local, previous))
        cursor = results[-1]

    if spec.shard and spec.mode != "tied_first":  # the tie all-reduces after the reductions, in tie order
        index = {bk.index: i for i, bk in enumerate(spec.layout.buckets)}
        with gm.graph.inserting_before(cursor.next):
            if spec.mode == "shard_aligned":
                for s in tied:
                    i = index[spec.layout.locate(s.name)[0].index]
                    results[i] = _tie_reduce_owned_shard(b, spec, s, results[i])
            else:
                results = _unsafe_tie_reduce_after(b, spec, tied, results, index)
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
    return gm, record


def _slot_ids(bucket: Bucket) -> list:
    """A bucket's identity as every rank of the gradient group must see it."""
    return [[s.name, s.offset, s.numel] for s in bucket.slots]


def _local_grad(b: GraphBuilder, spec: SyncSpec, s, grads, acc) -> fx.Node:
    bucket = spec.layout.locate(s.name)[0]
    g = grads[s.name]
    if s.name in acc:
        g = b.call(aten.add.Tensor, g, acc[s.name])
    return b.flat(g, bucket.dtype)


def _tie_reduce(b: GraphBuilder, spec: SyncSpec, x: fx.Node, s, role: str, elems) -> fx.Node:
    bucket = spec.layout.locate(s.name)[0]
    tag = {"role": role, "bucket": bucket.index, "params": [s.name], "group": spec.tie_groups[s.tie],
           "group_kind": f"tie:{s.tie}", "tie": s.tie, "elements": elems, "identity": f"tie {s.tie}"}
    return b.collective("all_reduce", x, spec.tie_groups[s.tie], 0, tag)


def _reduce_bucket(b: GraphBuilder, spec: SyncSpec, bucket: Bucket, grads, acc, local,
                   previous: fx.Node | None = None) -> fx.Node:
    kind = "reduce_scatter" if spec.shard else "all_reduce"
    dp_tag = {"role": "dp_reduce", "bucket": bucket.index, "params": [s.name for s in bucket.slots],
              "group": spec.group, "group_kind": "grad", "identity": _slot_ids(bucket)}
    parts = [local[s.name] if s.name in local else _local_grad(b, spec, s, grads, acc) for s in bucket.slots]
    flat = b.call(aten.cat.default, parts) if len(parts) > 1 else parts[0]
    pad = bucket.numel - (bucket.slots[-1].offset + bucket.slots[-1].numel)
    if pad:  # constant_pad_nd: an op Inductor lowers after decomposition (aten.zeros is not)
        flat = b.call(aten.constant_pad_nd.default, flat, [0, pad], 0.0)
    if spec.group_size == 1 and spec.mode != "unsafe_rs_first":
        # a gradient group of one rank (dp = cp = 1): the bucket is its own reduction, sent nowhere; a collective
        # would only copy it (gloo's reduce-scatter: twice) in the step's tail, where the pipeline waits
        return flat
    if spec.average and spec.group_size > 1:
        flat = b.call(aten.mul.Tensor, flat, 1.0 / spec.group_size)
    if spec.spread_nonfinite:
        flat = _spread_nonfinite(b, flat)
    if previous is not None:  # one reduction in flight: the previous bucket's whole gradients are freed first
        flat = b.after(flat, previous)
    return b.collective(kind, flat, spec.group, spec.group_size, dp_tag)


def _spread_nonfinite(b: GraphBuilder, flat: fx.Node) -> fx.Node:
    """flat x (1 + 0 x max(flat) + 0 x min(flat)): `flat` bit for bit while every element is finite (x 1), else NaN
    throughout (NaN and inf survive max or min, and 0 x either is NaN; 0 x a finite extreme is 0, never an overflow).
    Reduce-scattered, every shard of the bucket then holds a NaN where any rank's bucket held a non-finite element."""
    extremes = [b.call(aten.mul.Tensor, b.call(op, flat), 0.0) for op in (aten.amax.default, aten.amin.default)]
    one = b.call(aten.add.Tensor, b.call(aten.add.Tensor, *extremes), 1.0)
    return b.call(aten.mul.Tensor, flat, one)


def _tie_reduce_owned_shard(b: GraphBuilder, spec: SyncSpec, s, out: fx.Node) -> fx.Node:
    """shard_aligned: all-reduce over the tie group only the part of the tied gradient this shard owns."""
    bucket = spec.layout.locate(s.name)[0]
    start = spec.shard_rank * bucket.shard_numel(spec.group_size)
    lo, hi = owned_range(bucket.numel, s.offset, s.numel, spec.group_size, spec.shard_rank)
    if lo == hi:
        return out  # aligned layouts: the other members own none of it either
    a, z = s.offset + lo - start, s.offset + hi - start
    piece = _tie_reduce(b, spec, b.call(aten.slice.Tensor, out, 0, a, z), s, "tie_all_reduce_shard", (lo, hi))
    return b.call(aten.slice_scatter.default, out, piece, 0, a, z)


def _unsafe_tie_reduce_after(b: GraphBuilder, spec: SyncSpec, tied, results, index) -> list:
    """unsafe_rs_first, the #844 order on purpose: write each reduced shard back into this rank's
    unreduced bucket, all-reduce the tied weight's full view of it, keep the owned shard."""
    results, bufs = list(results), {}
    for s in tied:
        bucket = spec.layout.locate(s.name)[0]
        i = index[bucket.index]
        size = bucket.shard_numel(spec.group_size)
        start = spec.shard_rank * size
        if i not in bufs:
            flat = results[i].args[0].args[0]  # wait_tensor(reduce_scatter(flat, ...))
            bufs[i] = b.call(aten.slice_scatter.default, flat, results[i], 0, start, start + size)
        view = b.call(aten.slice.Tensor, bufs[i], 0, s.offset, s.offset + s.numel)
        view = _tie_reduce(b, spec, view, s, "tie_all_reduce", (0, s.numel))
        bufs[i] = b.call(aten.slice_scatter.default, bufs[i], view, 0, s.offset, s.offset + s.numel)
        results[i] = b.call(aten.slice.Tensor, bufs[i], 0, start, start + size)
    return results


def return_shards_only(gm: fx.GraphModule, n_outputs: int) -> tuple[fx.GraphModule, int]:
    """A flush or early graph under shard=True: its gradient outputs (the first `n_outputs`, None after
    insert_grad_sync) dropped, so it returns the reduced shards alone. Returns the outputs kept."""
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0][n_outputs:]),)
    gm.recompile()
    return gm, len(out.args[0])
