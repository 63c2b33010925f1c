"""Static verifier: a tied gradient is summed over its tie group before any DP reduction reads it.

For each tie, over the graph's data-flow (networkx reachability), it proves one of:

  (a) order: every data-parallel reduction that reads the tied gradient reads
      it only through the tie group's all-reduce: with the tie all-reduce
      nodes removed, no path is left from the gradient to the reduction; or
  (b) alignment: every member of the tie group shards the tied gradient
      identically (same bucket size, same offset modulo the shard grid, so
      data-parallel rank k owns the same elements on every stage), which makes
      reducing first and summing the owned shard afterwards exact.

and, given every member's sequence of tie-group collectives (exchanged at run
time by the cross-rank check, or read from every rank's dump), that each of
this tie's all-reduces meets the same tie on every member: collectives match
by position, so an all-reduce that meets another tie sums unrelated tensors.

Otherwise it reports a hazard naming the parameters, buckets, offsets and
ranks (Megatron-LM #844). Invariant: none established; it reads graphs only and changes nothing.

Usable three ways: `verify_graph(gm, ties)` on an FX graph, the same on a JSON
dump (`graph_to_json`), and `gradsched-verify DUMP...` on dumps of every rank.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import networkx as nx
import torch.fx as fx

from .bucketing import owned_range
from .graph_utils import META_KEY, collective_group, collective_kind, is_collective

REDUCTIONS = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class TieLayout:
    """Where one tie-group member holds its copy of the tied gradient."""
    rank: int
    param: str
    bucket: int
    offset: int
    numel: int
    bucket_numel: int
    shards: int

    def owned(self) -> list[tuple[int, int]]:
        return [owned_range(self.bucket_numel, self.offset, self.numel, self.shards, k)
                for k in range(self.shards)]


@dataclass
class TieCheck:
    tie: str
    group: str  # the tie group's name in the graph's collectives
    sources: list[str]  # nodes holding this rank's local tied gradient
    layouts: list[TieLayout]  # this rank's first, then the other members'
    # member rank -> identities of the tie group's collectives in its issue order (this rank's too);
    # empty: not exchanged (check_ranks=False), so the meeting is unproven
    sequences: dict = field(default_factory=dict)


@dataclass
class Verdict:
    rank: int
    proofs: list[str] = field(default_factory=list)
    hazards: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.hazards

    def __str__(self) -> str:
        head = f"rank {self.rank}: " + ("ok" if self.ok else f"HAZARD ({len(self.hazards)})")
        return "\n".join([head] + [f"  proof: {p}" for p in self.proofs] + [f"  hazard: {h}" for h in self.hazards])


class TiedGradientHazard(RuntimeError):
    pass


# ---- graphs as networkx ---------------------------------------------------------------
def graph_to_json(gm: fx.GraphModule, ties: list[TieCheck], rank: int) -> dict:
    nodes = []
    for n in gm.graph.nodes:
        coll = is_collective(n)
        nodes.append({
            "name": n.name, "op": n.op, "target": str(n.target),
            "inputs": [a.name for a in n.all_input_nodes],
            "collective": collective_kind(n) if coll else None,
            "group": collective_group(n) if coll else None,
            "tag": _jsonable(n.meta.get(META_KEY)),
        })
    return {"rank": rank, "nodes": nodes, "ties": [_tie_json(t) for t in ties]}


def _jsonable(tag):
    return None if tag is None else json.loads(json.dumps(tag, default=str))


def _tie_json(t: TieCheck) -> dict:
    d = asdict(t)
    d["layouts"] = [asdict(lay) for lay in t.layouts]
    return d


def _tie_from_json(d: dict) -> TieCheck:
    return TieCheck(d["tie"], d["group"], list(d["sources"]), [TieLayout(**lay) for lay in d["layouts"]],
                    {int(r): seq for r, seq in (d.get("sequences") or {}).items()})


def to_nx(graph) -> nx.DiGraph:
    """Data-flow graph with node attributes `collective` and `group`."""
    G = nx.DiGraph()
    if isinstance(graph, fx.GraphModule):
        for n in graph.graph.nodes:
            coll = is_collective(n)
            G.add_node(n.name, collective=collective_kind(n) if coll else None,
                       group=collective_group(n) if coll else None, tag=n.meta.get(META_KEY))
            G.add_edges_from((a.name, n.name) for a in n.all_input_nodes)
    else:
        for n in graph["nodes"]:
            G.add_node(n["name"], collective=n["collective"], group=n["group"], tag=n.get("tag"))
            G.add_edges_from((a, n["name"]) for a in n["inputs"])
    return G


# ---- the proof ------------------------------------------------------------------------
def verify_graph(graph, ties: list[TieCheck], rank: int = 0) -> Verdict:
    G = to_nx(graph)
    verdict = Verdict(rank)
    for tie in ties:
        _verify_tie(G, tie, verdict)
    return verdict


def _verify_tie(G: nx.DiGraph, tie: TieCheck, v: Verdict) -> None:
    colls = {n: d for n, d in G.nodes(data=True) if d["collective"]}
    tie_nodes = [n for n, d in colls.items() if d["group"] == tie.group]
    reductions = [n for n, d in colls.items() if d["group"] != tie.group and d["collective"] in REDUCTIONS]
    sources = [s for s in tie.sources if s in G]
    if not sources:
        v.hazards.append(f"tie {tie.tie}: none of its gradient nodes {tie.sources} is in the graph.")
        return
    if not any(nx.has_path(G, s, t) for s in sources for t in tie_nodes):
        v.hazards.append(f"tie {tie.tie}: the tied gradient is never all-reduced over its tie group "
                         f"{tie.group}: the stages' copies would drift apart.")
        return
    if not _meets_itself(tie, v):
        return
    cut = G.subgraph([n for n in G if n not in tie_nodes])
    readers = [r for r in reductions if any(nx.has_path(G, s, r) for s in sources)]
    unordered = [r for r in readers if any(nx.has_path(cut, s, r) for s in sources)]
    if not unordered:
        v.proofs.append(f"tie {tie.tie}: every DP reduction reading it ({', '.join(readers) or 'none'}) "
                        f"reads it only through the tie all-reduce ({', '.join(tie_nodes)}).")
        return
    mine = tie.layouts[0]
    if len(tie.layouts) < 2:
        v.hazards.append(f"tie {tie.tie}: {', '.join(unordered)} reduces '{mine.param}' before the tie "
                         "all-reduce, and the other members' layouts are unknown, so alignment is unproven.")
        return
    if all(lay.owned() == mine.owned() for lay in tie.layouts[1:]):
        v.proofs.append(f"tie {tie.tie}: reduced before the tie all-reduce ({', '.join(unordered)}), but every "
                        f"member shards it identically: dp rank k owns elements {mine.owned()} on each.")
        return
    where = "; ".join(f"rank {lay.rank} '{lay.param}' bucket {lay.bucket} offset {lay.offset} of "
                      f"{lay.bucket_numel} (owns {lay.owned()[0]} on dp rank 0)" for lay in tie.layouts)
    v.hazards.append(
        f"tie {tie.tie}: {', '.join(unordered)} reduce-scatters the tied gradient before its tie all-reduce, "
        f"and the copies are sharded differently: {where}. The tie all-reduce would add slices of different "
        "shards (Megatron-LM #844). Use mode='tied_first' (the default) or 'shard_aligned'.")


def _meets_itself(tie: TieCheck, v: Verdict) -> bool:
    """Each all-reduce of this tie is at the same position on every member, meeting this tie there."""
    if not tie.sequences:
        return True
    me = tie.layouts[0].rank
    ident = f"tie {tie.tie}"
    mine = [i for i, k in enumerate(tie.sequences.get(me, [])) if k == ident]
    for rank, seq in sorted(tie.sequences.items()):
        theirs = [i for i, k in enumerate(seq) if k == ident]
        if theirs != mine:
            clash = next((i for i in mine if i >= len(seq) or seq[i] != ident), None)
            met = "nothing" if clash is None or clash >= len(seq) else repr(seq[clash])
            v.hazards.append(
                f"tie {tie.tie}: its all-reduce #{clash} on the tie group {tie.group} meets {met} on rank {rank} "
                f"(rank {me} issues it at positions {mine}, rank {rank} at {theirs}): the copies would be summed "
                "with a different tensor. Every member must issue its tie collectives in one order (tie key).")
            return False
    return True


def check(graph, ties: list[TieCheck], rank: int = 0) -> Verdict:
    """verify_graph, raising TiedGradientHazard on a hazard."""
    verdict = verify_graph(graph, ties, rank)
    if not verdict.ok:
        raise TiedGradientHazard(str(verdict))
    return verdict


# ---- command line ---------------------------------------------------------------------
def load_dumps(paths: list[str]) -> list[dict]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise SystemExit(f"gradsched-verify: no .json graph dumps in {paths}")
    return [json.loads(f.read_text()) for f in files]


def verify_dumps(dumps: list[dict]) -> list[Verdict]:
    """Verify each rank's dump, completing its ties' layouts with the other ranks' dumps."""
    by_tie: dict[tuple[str, str], list[TieLayout]] = {}  # (tie, group): one per member
    sequences: dict[tuple[str, str], dict] = {}  # (tie, group): member rank -> tie identities in issue order
    for d in dumps:
        for t in d["ties"]:
            by_tie.setdefault((t["tie"], t["group"]), []).extend(TieLayout(**lay) for lay in t["layouts"][:1])
            sequences.setdefault((t["tie"], t["group"]), {})[d["rank"]] = [
                (n.get("tag") or {}).get("identity") for n in d["nodes"] if n["group"] == t["group"]]
    verdicts = []
    for d in dumps:
        ties = []
        for t in map(_tie_from_json, d["ties"]):
            known = {lay.rank for lay in t.layouts}
            ties.append(TieCheck(t.tie, t.group, t.sources,
                                 t.layouts + [lay for lay in by_tie[t.tie, t.group] if lay.rank not in known],
                                 sequences[t.tie, t.group]))
        verdicts.append(verify_graph(d, ties, d["rank"]))
    return verdicts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gradsched-verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+", help="JSON graph dumps (files or directories), one per rank")
    args = ap.parse_args(argv)
    verdicts = verify_dumps(load_dumps(args.dumps))
    for v in verdicts:
        print(v)
    bad = [v.rank for v in verdicts if not v.ok]
    print(f"verifier: {'ok' if not bad else 'hazard on ranks ' + str(bad)} ({len(verdicts)} graphs)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
