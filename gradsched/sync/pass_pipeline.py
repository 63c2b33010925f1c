"""The pass pipeline: every FX pass gradsched runs, in the order it runs them, written once.

Each entry is a pass of `passes/` (its module states the invariant it establishes), the graph it
rewrites or reads, and when it applies. A graph's life goes down the list: Dynamo's graph, then
AOTAutograd's forward and backward graphs, the graphs that reduce buckets, the backward cut in B and W,
the check before a graph's first collective, the copy Inductor compiles. Each of those places runs
its graph's entries with `run(graph, gm, conditions, specs)`: the applicable ones, in this order; what
a pass needs comes in its spec. Between the backward graph's entries and the sync graphs' lies the
SyncPlan (`gradsched.sync.sync_plan.plan_sync`: buckets and which graph reduces each), plain data, not
a graph pass.

`GRADSCHED_PRINT_GRAPHS=1` prints each graph before its first rewrite and after every rewrite, named by
pass; `docs/design.md`'s pass table is `table()` (tests/test_pass_pipeline.py holds them equal).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from gradsched.passes import grad_ready_order, insert_grad_sync, sink_waits, verify_graph
from gradsched.passes.context_parallel import lower_attention_to_ring
from gradsched.passes.cut_backward import cut_backward
from gradsched.passes.defer_waits import defer_waits
from gradsched.passes.grad_sync import return_shards_only
from gradsched.passes.param_gather import gather_params
from gradsched.passes.tensor_parallel import shard_for_tensor_parallel
from gradsched.passes.tp_grad_buckets import bucket_tp_grad_sums
from gradsched.passes.tp_torch_level import torch_level
from gradsched.passes.unlowered_attention import unlowered_attention
from gradsched.passes.verify_tensor_parallel import verify_tensor_parallel
from gradsched.passes.agreement import insert_agreement

# the graphs, in the order of a graph's life, and what each is
GRAPHS = {
    "dynamo": "Dynamo's graph, before AOTAutograd",
    "forward": "AOTAutograd's forward graph",
    "backward": "AOTAutograd's backward graph",
    "sync": "a graph that reduces buckets: the last micro-batch's backward, the flush graph, an early graph",
    "cut": "a backward graph, plain or reducing",
    "checked": "a sync graph, before its first collective",
    "compiled": "the copy of every graph that is compiled",
}


@dataclass(frozen=True)
class Conditions:
    """What decides which passes apply: plain values from the options, the plan and the graph's place."""
    cp: int = 1
    tp: int = 1
    shard: bool | str = False
    reshard_after_forward: bool = True
    zero_bubble: bool = False  # the schedule runs each backward as B and W
    check_ranks: bool = False
    where: str = ""  # a sync graph: "backward", "flush" or "early{j}"

    @classmethod
    def of(cls, options, **kw) -> "Conditions":
        return cls(shard=options.shard, reshard_after_forward=options.reshard_after_forward,
                   check_ranks=options.check_ranks, **kw)


@dataclass(frozen=True)
class Pass:
    name: str
    graph: str  # a key of GRAPHS
    when: str  # when it applies, in words (docs/design.md's table)
    applies: Callable[[Conditions], bool]
    fn: Callable  # the pass, from passes/: (graph, spec) -> (graph, record)
    rewrites: bool = True  # False: it reads the graph (an analysis, a check)
    call: Callable | None = None  # how to call fn with its spec, where its signature is not (graph, spec)

    @property
    def module(self) -> str:
        return "passes/" + self.fn.__module__.rsplit(".", 1)[-1] + ".py"


def _always(_: Conditions) -> bool:
    return True


PIPELINE: tuple[Pass, ...] = (
    Pass("torch_level", "dynamo", "tp > 1", lambda c: c.tp > 1, torch_level),
    Pass("shard_for_tensor_parallel", "dynamo", "tp > 1", lambda c: c.tp > 1, shard_for_tensor_parallel),
    Pass("lower_attention_to_ring", "dynamo", "cp > 1", lambda c: c.cp > 1, lower_attention_to_ring),
    Pass("unlowered_attention", "dynamo", "cp > 1", lambda c: c.cp > 1, unlowered_attention, rewrites=False),
    Pass("gather_params", "forward", 'shard="params"', lambda c: c.shard == "params", gather_params),
    Pass("gather_params", "backward", 'shard="params", reshard_after_forward',
         lambda c: c.shard == "params" and c.reshard_after_forward, gather_params),
    Pass("bucket_tp_grad_sums", "backward", "tp > 1", lambda c: c.tp > 1, bucket_tp_grad_sums),
    Pass("grad_ready_order", "backward", "always", _always, grad_ready_order, rewrites=False,
         call=lambda gm, grad_names: (gm, grad_ready_order(gm, grad_names))),
    Pass("verify_tensor_parallel", "backward", "tp > 1", lambda c: c.tp > 1, verify_tensor_parallel, rewrites=False,
         call=lambda gm, spec: (gm, verify_tensor_parallel(gm, spec))),
    Pass("insert_grad_sync", "sync", "always", _always, insert_grad_sync),
    Pass("return_shards_only", "sync", 'a flush or early graph, shard=True or "params"',
         lambda c: bool(c.shard) and c.where != "backward", return_shards_only),
    Pass("sink_waits", "sync", "always", _always, sink_waits, call=lambda gm, _: sink_waits(gm)),
    Pass("cut_backward", "cut", "a zero-bubble schedule (zb1p, zbv, dualpipev)", lambda c: c.zero_bubble,
         cut_backward),
    Pass("verify_graph", "checked", "always", _always, verify_graph, rewrites=False,
         call=lambda gm, spec: (gm, verify_graph(gm, *spec))),
    Pass("insert_agreement", "compiled", "check_ranks", lambda c: c.check_ranks, insert_agreement),
    Pass("defer_waits", "compiled", "an early graph (several stages a rank)", lambda c: c.where.startswith("early"),
         defer_waits, call=lambda gm, _: defer_waits(gm)),
)


class Later:
    """A spec built from the records of the passes before it on the same graph."""

    def __init__(self, build: Callable[[dict], object]):
        self.build = build


def passes_of(graph: str) -> list[Pass]:
    if graph not in GRAPHS:
        raise KeyError(f"no graph {graph!r} in the pass pipeline; its graphs are {list(GRAPHS)}")
    return [p for p in PIPELINE if p.graph == graph]


def applies(graph: str, name: str, conditions: Conditions) -> bool:
    """Whether pass `name` runs on `graph` under `conditions` (where a call site chooses what to build)."""
    found = [p for p in passes_of(graph) if p.name == name]
    if not found:
        raise KeyError(f"no pass {name!r} on the {graph} graph in the pass pipeline")
    return found[0].applies(conditions)


def applicable(graphs: tuple[str, ...], conditions: Conditions) -> list[str]:
    """The names of the passes that apply to a graph whose life goes through `graphs`, in order (the report)."""
    return [p.name for p in PIPELINE if p.graph in graphs and p.applies(conditions)]


def run(graph: str, gm: fx.GraphModule, conditions: Conditions, specs: dict, what: str = "") -> dict:
    """Run on `gm` (in place) the passes of `graph` that apply, in the pipeline's order. `specs`: pass
    name -> its spec, or a `Later` building it from the records so far; a pass that applies needs one
    (a pass without a spec, such as sink_waits, takes None). Returns pass name -> its record, in order."""
    records, printed = {}, False
    for p in passes_of(graph):
        if not p.applies(conditions):
            continue
        if p.name not in specs:
            raise KeyError(f"gradsched's pass pipeline: pass {p.name} applies to the {graph} graph here, but "
                           "its caller gave it no spec")
        spec = specs[p.name]
        if isinstance(spec, Later):
            spec = spec.build(records)
        if p.rewrites and not printed:
            _print(gm, f"{what or GRAPHS[graph]}, before its passes")
            printed = True
        _, records[p.name] = (p.call or p.fn)(gm, spec)
        if p.rewrites:
            _print(gm, f"{what or GRAPHS[graph]}, after {p.name}")
    return records


def table() -> list[tuple[str, str, str, str, str]]:
    """(#, pass, graph, when, module) of every entry: the first columns of docs/design.md's pass table."""
    return [(str(i), f"`{p.name}`", p.graph, p.when, f"`{p.module}`") for i, p in enumerate(PIPELINE, 1)]


def _print(gm: fx.GraphModule, what: str) -> None:
    if os.environ.get("GRADSCHED_PRINT_GRAPHS"):
        print(f"==== gradsched: {what} ====\n{gm.print_readable(print_output=False)}", flush=True)
