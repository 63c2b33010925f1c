"""Cross-rank check: every rank of a group must issue the same collectives in the same order.

Before a sync graph's first collective, each rank sends, over each of its
groups, the sequence (op, dtype, numel) of that group's collectives in graph
order, plus the layout of any tied gradient it holds. A difference becomes a
readable error naming the first differing collective, instead of a hang or
silently wrong gradients. Tied copies whose shapes or dtypes differ are
caught here too.
"""
from __future__ import annotations

import torch.distributed as dist
import torch.fx as fx

from gradsched.passes.graph_utils import collective_group, collective_kind, is_collective


class CollectiveMismatch(RuntimeError):
    pass


def sequence(gm: fx.GraphModule) -> dict[str, list[tuple]]:
    """Group name -> [(op, dtype, numel), ...] in graph (issue) order."""
    seqs: dict[str, list[tuple]] = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            v = n.args[0].meta["val"]
            seqs.setdefault(collective_group(n), []).append((collective_kind(n), str(v.dtype), v.numel()))
    return seqs


def first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def exchange_and_check(sync, gm: fx.GraphModule, layouts: dict) -> dict[str, list]:
    """Exchange over the gradient group, then each tie group; return the peers' tie layouts."""
    seqs = sequence(gm)
    plan = sync.plan
    pg, ranks, _ = sync.grad_group()
    groups = [("gradient group", pg, ranks, None, None)]
    for name, tie in sorted(sync.ties.items(), key=lambda kv: kv[1].key):
        tranks, tpg = sync.tie_group_of(tie)
        groups.append((f"tie group of {tie.key}", tpg, tranks, tie.key, sync.state.params[name]))
    peers: dict[str, list] = {}
    for what, pg, ranks, tie_key, p in groups:
        mine = {"rank": plan.rank, "seq": seqs.get(pg.group_name, []),
                "layout": layouts.get(tie_key), "param": (tuple(p.shape), str(p.dtype)) if p is not None else None}
        got = [None] * len(ranks)
        dist.all_gather_object(got, mine, group=pg)
        for other in got:
            if tie_key and other["param"] != mine["param"]:
                raise CollectiveMismatch(
                    f"tied copies differ on the {what}: rank {plan.rank} holds shape/dtype {mine['param']}, "
                    f"rank {other['rank']} holds {other['param']}. Tied copies must have the same shape and "
                    "dtype: check the model split and any dtype casts of one stage.")
            if other["seq"] != mine["seq"]:
                i = first_difference(mine["seq"], other["seq"])
                show = lambda s: s[i] if i < len(s) else "nothing (sequence ends)"  # noqa: E731
                raise CollectiveMismatch(
                    f"collective order differs on the {what} (ranks {list(ranks)}): at collective #{i} rank "
                    f"{plan.rank} issues {show(mine['seq'])} but rank {other['rank']} issues "
                    f"{show(other['seq'])} ({len(mine['seq'])} vs {len(other['seq'])} collectives). Running "
                    "would hang or mix unrelated tensors; give every rank the same gradsched options and model.")
            if tie_key and other["rank"] != plan.rank:
                peers.setdefault(tie_key, []).append(other["layout"])
    return peers

