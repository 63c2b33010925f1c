"""Open each group's collectives in a graph with an agreement: every rank runs the same sequence.

Invariant established: for every process group the graph talks to, its first collective on that
group is an all-gather of one int64, the digest of the graph's whole sequence of collectives on
the group (op, dtype, numel, identity, in graph order), followed by `spec.check` on the gathered
digests; every collective of the group that depends on no other of the group's collectives takes
its input through a zero made from the check's result (x - 0.0: bit for bit x); one that reads
another group's collective (a tied bucket's reduce-scatter reading the tie all-reduce) takes it
at that collective's input instead, so no extra pass over a reduced buffer is made. No compiler
can therefore issue any of the group's collectives before the check has run. Every group's
agreement stands before the graph's first collective.

The all-gathers are issued where the graph's computation begins (their input is a constant) and waited
for just before its first collective: their latency hides behind the compute that precedes it (a
backward's, all of it but the last bucket's).

Why in the graph, every run: the digests are exchanged by the graph itself, as the first
collective of the group, so each rank compares with the graph its peers run at the same moment.
A rank that recompiled alone still meets its peers' (older) graphs at that first all-gather,
which every graph gradsched compiles starts with. What the check does with the gathered digests
(raise at once, or poison the group's inputs with NaN and compare later on the host, without
waiting for the device) is the caller's: gradsched.sync.agreement_check. No extra process group, no
store round trip per run: one 8-byte all-gather per group per graph run.

Assumes: functional collectives (graph_utils.COLLECTIVES) whose group is their last argument and
whose input's `meta["val"]` is set; `spec.check(gathered, digest, group)` returns a float32 scalar
on the gathered tensor's device: zero when every digest is `digest` (else it raises, or returns
NaN). `meta["val"]` is set on every inserted node.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph_utils import META_KEY, GraphBuilder, c10d, collective_group, collective_kind, is_collective


@dataclass(frozen=True)
class AgreementSpec:
    check: object  # the op run on the gathered digests: (gathered int64 [n], digest, group) -> float32 scalar
    group_sizes: dict  # group name -> its number of ranks


@dataclass(frozen=True)
class AgreementRecord:
    sequences: dict  # group name -> [(op, dtype, numel, identity json), ...] in issue order
    digests: dict  # group name -> the sequence's digest (what the graph's first all-gather carries)


def collective_sequences(gm: fx.GraphModule) -> dict[str, list[tuple]]:
    """Group name -> [(op, dtype, numel, identity), ...] in graph (issue) order."""
    seqs: dict[str, list[tuple]] = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            v = n.args[0].meta["val"]
            ident = json.dumps((n.meta.get(META_KEY) or {}).get("identity"))
            # a size that depends on an input's dynamic shape is a symbol, named differently by each process
            numel = v.numel() if isinstance(v.numel(), int) else "dynamic"
            seqs.setdefault(collective_group(n), []).append((collective_kind(n), str(v.dtype), numel, ident))
    return seqs


def digest(seq: list[tuple]) -> int:
    """A positive int64 naming a sequence (62 bits of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(json.dumps(seq).encode()).digest()[:8], "little") >> 2


def insert_agreement(gm: fx.GraphModule, spec: AgreementSpec) -> tuple[fx.GraphModule, AgreementRecord]:
    seqs = collective_sequences(gm)
    digests = {g: digest(s) for g, s in seqs.items()}
    b = GraphBuilder(gm)
    first = next((n for n in gm.graph.nodes if is_collective(n)), None)
    start = next(n for n in gm.graph.nodes if n.op != "placeholder")  # issued here, waited for before `first`
    for group, d in digests.items():
        mine = [n for n in gm.graph.nodes if is_collective(n) and collective_group(n) == group]
        with gm.graph.inserting_before(start):
            own = b.call(torch.ops.aten.full.default, [1], d, dtype=torch.int64,
                         device=mine[0].args[0].meta["val"].device)
            issued = b.call(c10d.all_gather_into_tensor.default, own, spec.group_sizes[group], group)
        with gm.graph.inserting_before(first):  # before every collective: a tie point may precede mine[0]
            gathered = b.call(c10d.wait_tensor.default, issued)
            zero = b.call(spec.check, gathered, d, group)
        for c in _roots(gm, set(mine)):
            at = _tie_point(c)
            inp = at.args[0]
            with gm.graph.inserting_before(at):
                z = b.call(torch.ops.prims.convert_element_type.default, zero, inp.meta["val"].dtype)
                at.args = (b.call(torch.ops.aten.sub.Tensor, inp, z),) + tuple(at.args[1:])
    if digests:
        gm.graph.lint()
        gm.recompile()
    return gm, AgreementRecord(seqs, digests)


def _tie_point(c: fx.Node) -> fx.Node:
    """Where the zero goes for collective c: at c's input, or, when c reads another group's
    collective (a tied bucket's reduce-scatter reading the tie all-reduce), at that one's input,
    so that no extra pass over a reduced buffer is made; up the chain."""
    while True:
        w = c.args[0]
        if not (isinstance(w, fx.Node) and w.target is c10d.wait_tensor.default and is_collective(w.args[0])):
            return c
        c = w.args[0]


def _roots(gm: fx.GraphModule, group_nodes: set) -> list[fx.Node]:
    """The group's collectives that read (through any path) no other collective of the group."""
    downstream: set = set()  # nodes reading some collective of the group
    roots = []
    for n in gm.graph.nodes:
        reads = any(a in downstream or a in group_nodes for a in n.all_input_nodes)
        if reads:
            downstream.add(n)
        if n in group_nodes and not reads:
            roots.append(n)
    return roots
