"""Build the gradient sync of a rank that holds several stages (looped and V schedules), at compile time.

    build_part(bw_gm, ...)     each stage graph's backward compiled as it comes (whole, or B and W); autograd
                               (or W) accumulates its gradients in .grad every micro-batch
    build_union(parts, ...)    once every stage graph has one: the plan over all of the rank's gradients,
                               its flush graph and (B and W) the early graphs of the buckets final before
                               the last stage's W

The graphs are gradsched.sync.stage_build's; a BuiltStage is what GradSync runs, as for one stage.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.fx as fx

from gradsched.passes.bucketing import BucketLayout, place_after

from gradsched.options import SyncOptions
from gradsched.sync import pass_pipeline
from gradsched.sync.compile import compile_graph
from gradsched.sync.preflight import check_backward_graph
from gradsched.passes.verify_tensor_parallel import TensorParallelProof
from gradsched.sync.param_shards import ParamShards
from gradsched.sync.stage_build import (BuiltStage, Halves, agreement_name, backward_specs, check_sharded, cut_graph,
                                        flush_graph, run_passes)
from gradsched.sync.stage_setup import StageSetup
from gradsched.sync.sync_plan import plan_layout, plan_sync


@dataclass
class StagePart:
    """One stage graph of a rank that holds several: its gradients' ready order, its parameters (by the rank's
    names), and its backward compiled whole or as B and W. Autograd (or W) accumulates its gradients in .grad
    every micro-batch; the rank's flush reduces them, or an early graph as the part finishes (build_union)."""
    ready: list
    params: dict
    grad_names: dict  # backward output position -> parameter name
    plain: object
    plain_halves: Halves | None
    tp_proof: TensorParallelProof | None = None  # tp > 1: passes/verify_tensor_parallel's proof of this backward
    tp_sharded: frozenset = frozenset()  # tp > 1: the names whose Parameters are this rank's TP shards
    param_inputs: tuple = ()  # shard="params": the buckets whose shards its backward takes, appended


def build_part(bw_gm: fx.GraphModule, example_inputs, grad_names: dict[int, str], params: dict,
               setup: StageSetup, options: SyncOptions, zero_bubble: bool,
               tp_sharded: frozenset = frozenset(), shards: ParamShards | None = None,
               param_names: dict | None = None) -> StagePart:
    """A stage graph of a rank of several stages (names: the rank's, a tie merged on the rank under one;
    `tp_sharded`: under tp > 1 the names whose Parameters are TP shards; `shards`, shard="params": where the
    parameters live, `param_names` this graph's forward placeholder -> parameter name, as build_stage's)."""
    conditions, specs = backward_specs(setup, options, grad_names, zero_bubble, tp_sharded)
    bw_gm, records, param_inputs, example_inputs = run_passes("backward", bw_gm, example_inputs, setup, conditions,
                                                              specs, shards, param_names)
    proof = records.get("verify_tensor_parallel")
    if proof is not None:
        proof.raise_if_unsafe()
    ready = records["grad_ready_order"]
    what = f"a backward graph of pipeline rank {setup.stage}'s stages ({ready[0].name if ready else 'no gradient'}...)"
    if pass_pipeline.applies("cut", "cut_backward", conditions):
        halves = cut_graph(bw_gm, example_inputs, set(grad_names), options, what)
        return StagePart(ready, params, dict(grad_names), None, halves, proof, tp_sharded, param_inputs)
    return StagePart(ready, params, dict(grad_names),
                     compile_graph(bw_gm, example_inputs, options.compiler, agree=agreement_name(options, what)), None,
                     proof, tp_sharded, param_inputs)


def build_union(parts: list[StagePart], setup: StageSetup, options: SyncOptions,
                order: tuple[int, ...] = (), shards: ParamShards | None = None) -> BuiltStage:
    """The sync of a rank of several stages: one plan over every stage graph's gradients (each once), reduced
    after the schedule by one flush graph (placement 'flush': no one backward graph holds the rank's gradients).
    Ties across ranks are summed there, first, as at one stage.

    `order`: the parts in the order their last W finished on the first step (B and W, shard=True), or empty.
    Given, the gradients are laid out in that order and each bucket whose every gradient is final before the
    last part finishes goes to that point's early graph ("early{j}", passes/bucketing.place_after), run there
    and waited for at the flush (gradsched.sync.early_reduce). Under shard="params" (`shards`) the gradients
    take the layout the parameters live in (each stage graph's buckets its own, param_shards.shard_more)."""
    params = {n: p for part in parts for n, p in part.params.items()}
    ready, final_at = finishing_points([part.ready for part in parts], order)
    check_backward_graph(setup, ready, None)
    ties = {n: t.key for n, t in setup.ties.items()}
    layout = None
    if shards is not None:
        check_sharded(ready, shards)
        layout = shards.layout
    elif len(order) > 1:  # no bucket spans two points: each point's gradients bucketed on their own
        points = [[r for r in ready if final_at[r.name] == j] for j in range(len(order))]
        layout = _concatenated([plan_layout(p, options, len(setup.grad_group.ranks), ties) for p in points if p])
    plan = plan_sync(ready, options, stage=setup.stage, rank=setup.rank, placement="flush",
                     grad_group=setup.grad_group, tie_groups=setup.tie_groups, ties=ties,
                     param_dtypes={n: p.dtype for n, p in params.items()}, layout=layout)
    # not under shard=False (all-reduced buckets hand out views, read only once waited), nor for a gradient group
    # of one rank: its reduction is a copy, nothing to overlap, and it would hold a second copy of the gradients
    # until the flush (an early reduction's input and output both live until then)
    # (and not under an explicit placement="flush": every bucket after the schedule)
    if len(order) > 1 and plan.shard and len(setup.grad_group.ranks) > 1 and setup.placement == "tied_at_flush":
        plan = dataclasses.replace(plan, graphs=place_after(plan.layout, final_at, len(order)))
    early = any(w.startswith("early") for w in plan.graphs)
    proofs = [part.tp_proof for part in parts if part.tp_proof is not None]
    proof = TensorParallelProof(all(q.ok for q in proofs), [x for q in proofs for x in q.proved],
                                [x for q in proofs for x in q.hazards]) if proofs else None
    return BuiltStage(plan, params, None, {w: flush_graph(plan, params, options, w) for w in plan.graphs},
                      order=tuple(order) if early else (), tp_sharded=frozenset().union(*(q.tp_sharded for q in parts)),
                      tp_proof=proof)


def finishing_points(parts_ready: list[list], order: tuple[int, ...]) -> tuple[list, dict]:
    """(every gradient once, in the order the parts finish (`order`; else as given), and name -> the point at
    which it is final: its last writer's position in that order; a gradient two parts write, a tie on the rank,
    is final after the later)."""
    ready, final_at = {}, {}
    for j, part in enumerate([parts_ready[i] for i in order] if order else parts_ready):
        for r in part:
            ready.setdefault(r.name, r)
            final_at[r.name] = j
    return list(ready.values()), final_at


def _concatenated(layouts: list[BucketLayout]) -> BucketLayout:
    """One layout of several, in order, the buckets numbered on."""
    buckets = [b for lay in layouts for b in lay.buckets]
    return BucketLayout(tuple(dataclasses.replace(b, index=i) for i, b in enumerate(buckets)), layouts[0].shards)
