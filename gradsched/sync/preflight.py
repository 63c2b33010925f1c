"""The checks a stage's gradient sync passes before it may run: at compile time, and before a
sync graph's first collective.

At compile time (`check_backward_graph`, local, no communication):
  - one backward graph per stage (a second one with other parameters is a graph break);
  - a weight of the model trained through one Parameter on this stage, not two copies;
  - every tied parameter of this stage gets a gradient in its backward graph.

Before a sync graph's first collective (`check_sync_graph`):
  - the cross-rank check (gradsched.sync.fingerprint) over each group the graph talks to: the
    same collectives, matched by identity, on every rank; tied copies of one shape and dtype;
  - the verifier (gradsched.passes.verify), per tie, from every member's layout;
  - a hazard is refused unless allow_hazard=True.
A graph without tie collectives (split's backward graph) talks to its gradient group only:
the other stages are still inside the schedule, and a check over a tie group would deadlock.
"""
from __future__ import annotations

import json
import os
import warnings

from gradsched.passes import GradSpec, TieCheck, TieLayout
from gradsched.passes.verify import TiedGradientHazard, Verdict, graph_to_json

from gradsched.sync import fingerprint, pass_pipeline
from gradsched.options import SyncOptions
from gradsched.sync.stage_setup import StageSetup
from gradsched.sync.sync_plan import SyncPlan
from gradsched.sync.ties import TieMismatch


def check_backward_graph(setup: StageSetup, ready: list[GradSpec], first: list[GradSpec] | None) -> None:
    """Refuse a backward graph this stage cannot sync (`first`: the ready order of the stage's
    first backward graph, if this is a recompile)."""
    names = [r.name for r in ready]
    if first is not None and [r.name for r in first] != names:
        raise RuntimeError(
            "gradsched: a second backward graph with different parameters was compiled for this stage "
            f"(graph break?). First: {[r.name for r in first]}; now: {names}. "
            "Compile the stage with fullgraph=True.")
    for group in setup.aliases:
        copies = sorted(group & set(names))
        if len(copies) > 1:
            raise TieMismatch(
                f"stage {setup.stage} trains {copies} as separate parameters, but they are one weight of the "
                "model: the pipeline split gave one of its uses a copy of its own, which no tie records, so "
                "the copies would get different gradients and drift apart. Choose split points that keep "
                "every use of a shared weight but one per stage on one side, or untie it.")
    unknown = sorted(set(setup.ties) - set(names))
    if unknown:
        raise TieMismatch(f"tied parameter(s) {unknown} of stage {setup.stage} get no gradient in its "
                          "backward graph: the tie declaration does not match the model.")


def check_sync_graph(setup: StageSetup, plan: SyncPlan, graph, params: dict, options: SyncOptions) -> Verdict:
    """Cross-rank check and verifier for one built sync graph (gradsched.sync.stage_build.SyncGraph);
    raises on a mismatch or, without allow_hazard, a hazard. Every rank of the graph's groups
    calls it before the graph's first collective."""
    names = {s.name for b in graph.layout.buckets for s in b.slots}
    ties = {n: t for n, t in setup.ties.items() if n in names}
    layouts = {}
    for name, tie in ties.items():
        bucket, slot = plan.layout.locate(name)
        layouts[tie.key] = TieLayout(setup.rank, name, bucket.index, slot.offset, slot.numel,
                                     bucket.numel, plan.layout.shards)
    peers, sequences = {}, {}
    if options.check_ranks:
        peers, sequences = fingerprint.exchange_and_check(setup, graph.gm, layouts, ties, params)
    checks = [TieCheck(t.key, plan.tie_groups[t.key].name, graph.record.sources[n],
                       [layouts[t.key]] + peers.get(t.key, []), sequences.get(t.key, {}))
              for n, t in sorted(ties.items(), key=lambda kv: kv[1].key)]
    verdict = pass_pipeline.run("checked", graph.gm, pass_pipeline.Conditions.of(options),
                                {"verify_graph": (checks, setup.rank)})["verify_graph"]
    if options.dump_dir:
        os.makedirs(options.dump_dir, exist_ok=True)
        suffix = "" if len(plan.graphs) == 1 else f".{graph.where}"
        with open(os.path.join(options.dump_dir, f"rank{setup.rank}{suffix}.json"), "w") as f:
            json.dump(graph_to_json(graph.gm, checks, setup.rank), f)
    if not verdict.ok:
        if not options.allow_hazard:
            raise TiedGradientHazard(f"gradsched refuses to run this gradient sync:\n{verdict}")
        warnings.warn(f"gradsched: running a graph with a known hazard (allow_hazard=True):\n{verdict}")
    return verdict
