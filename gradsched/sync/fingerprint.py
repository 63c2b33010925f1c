"""Cross-rank check: every rank of a group must issue the same collectives in the same order.

Before a sync graph's first collective, each rank sends, over each of its
groups, the sequence of that group's collectives in graph order, each as
(op, dtype, numel, identity): the identity is what the collective carries, the
tie key for a tie all-reduce, the bucket's slot list (parameter, offset, numel)
for a data-parallel reduction. Collectives are thus matched by identity, not by
position: two ties of equal size issued in different orders are caught, not
summed with each other. A difference becomes a readable error naming both
sides, instead of a hang or silently wrong gradients. Tied copies whose shapes
or dtypes differ are caught here too.
"""
from __future__ import annotations

import json

import torch.distributed as dist
import torch.fx as fx

from gradsched.passes.agreement import collective_sequences


class CollectiveMismatch(RuntimeError):
    pass


sequence = collective_sequences  # group name -> [(op, dtype, numel, identity), ...] in issue order


def describe(c) -> str:
    """One collective of a sequence, for a message."""
    if c is None:
        return "nothing (its sequence ends)"
    op, dtype, numel, ident = c
    ident = json.loads(ident)
    if isinstance(ident, list):  # a bucket: its slots
        names = ", ".join(f"{n}@{o}+{k}" for n, o, k in ident[:4]) + (", ..." if len(ident) > 4 else "")
        ident = f"bucket [{names}]"
    return f"{op} of {ident or 'an untagged tensor'} ({dtype.replace('torch.', '')}, {numel} elements)"


def compare_sequences(what: str, ranks, me: int, mine: list, other_rank: int, other: list) -> None:
    """Raise CollectiveMismatch naming both sides at the first collective that differs."""
    if mine == other:
        return
    i = first_difference(mine, other)
    at = lambda s: s[i] if i < len(s) else None  # noqa: E731
    raise CollectiveMismatch(
        f"collectives differ on the {what} (ranks {list(ranks)}): at collective #{i} rank {me} issues "
        f"{describe(at(mine))} but rank {other_rank} issues {describe(at(other))} ({len(mine)} vs {len(other)} "
        "collectives). Running would hang or sum unrelated tensors. The ranks compiled different gradient "
        "syncs: give every rank the same gradsched options and the same model.")


def first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def exchange_and_check(setup, gm: fx.GraphModule, layouts: dict, ties: dict, params: dict) -> tuple[dict, dict]:
    """Exchange over the gradient group, then the group of each tie in `ties` (name -> Tie: the ties
    this graph reduces; a graph without any talks to its gradient group only). `setup` is the
    stage's StageSetup; `params` its parameters by name (tied copies' shapes are compared).

    Returns (tie key -> the other members' layouts, tie key -> {rank: identities of
    the tie group's collectives in that rank's issue order}) for the verifier."""
    from gradsched.sync.stage_setup import process_group
    seqs = sequence(gm)
    groups = [("gradient group", setup.grad_group, None, None)]
    for name, tie in sorted(ties.items(), key=lambda kv: kv[1].key):
        groups.append((f"tie group of {tie.key}", setup.tie_groups[tie.key], tie.key, params[name]))
    peers: dict[str, list] = {}
    sequences: dict[str, dict] = {}
    me = setup.rank
    for what, group, tie_key, p in groups:
        mine = {"rank": me, "seq": seqs.get(group.name, []),
                "layout": layouts.get(tie_key), "param": (tuple(p.shape), str(p.dtype)) if p is not None else None}
        got = [None] * len(group.ranks)
        dist.all_gather_object(got, mine, group=process_group(group))
        for other in got:
            if tie_key and other["param"] != mine["param"]:
                raise CollectiveMismatch(
                    f"tied copies differ on the {what}: rank {me} holds shape/dtype {mine['param']}, "
                    f"rank {other['rank']} holds {other['param']}. Tied copies must have the same shape and "
                    "dtype: check the model split and any dtype casts of one stage.")
            compare_sequences(what, group.ranks, me, mine["seq"], other["rank"], other["seq"])
            if tie_key and other["rank"] != me:
                peers.setdefault(tie_key, []).append(other["layout"])
                sequences.setdefault(tie_key, {})[other["rank"]] = _tie_keys(other["seq"])
        if tie_key:
            sequences.setdefault(tie_key, {})[me] = _tie_keys(mine["seq"])
    return peers, sequences


def _tie_keys(seq: list) -> list:
    """The identities of a tie group's collectives, for the verifier."""
    return [json.loads(c[3]) for c in seq]

