"""check_tp_replicas=True, a debug option: after each applied step, every parameter held whole on every TP rank
(norm weights, biases after a row-parallel matmul, k/v replicated under GQA) is bitwise equal across its TP group.

The verifier proves each such gradient is summed over TP exactly once in the graph, so equal replicas stay equal.
This catches what no graph shows: a hook or an optimizer reading something rank-local, a kernel that is not
deterministic, a checkpoint resumed onto diverged replicas. Every TP rank gathers the same bytes and decides from
them alone, so every rank of the group raises the same error, or none does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gradsched.sync.stage_setup import process_group
from gradsched.sync.watchdog import JOURNAL


class ReplicasDiverged(RuntimeError):
    pass


@torch.no_grad()
def check_tp_replicas(sync, step: int) -> None:
    """Compare this stage's TP-replicated parameters over its TP group (a collective of the TP group: every TP rank
    calls it after the same step); raise ReplicasDiverged naming the first that differs."""
    group = sync.setup.tp_group
    if group is None:
        return
    whole = sync.full_parameters()  # shard="params": gathered over the gradient group first
    names = [n for n in sync.params if n not in sync.built.tp_sharded]  # the graph's order: alike on every TP rank
    if not names:
        return
    flat = [whole[n].detach().contiguous().reshape(-1).view(torch.uint8) for n in names]
    own = torch.cat(flat)
    gathered = own.new_empty(len(group.ranks) * own.numel())  # flat: gloo's all_gather_into_tensor wants it so
    pg = process_group(group)
    with JOURNAL.entry("check_tp_replicas: the TP-replicated parameters' bytes", "collective", pg, "all_gather",
                       gathered.numel(), gathered.dtype):
        dist.all_gather_into_tensor(gathered, own, group=pg)
    rows = gathered.view(len(group.ranks), -1)
    differs = (rows != rows[0]).any(dim=0)
    if not bool(differs.any()):
        return
    at = 0
    for name, f in zip(names, flat):
        bad = [group.ranks[i] for i in range(len(group.ranks)) if not torch.equal(rows[i, at:at + f.numel()],
                                                                                  rows[0, at:at + f.numel()])]
        if bad:
            raise ReplicasDiverged(
                f"gradsched check_tp_replicas: after step {step}, parameter {name!r} differs on rank(s) {bad} from "
                f"rank {group.ranks[0]} of its TP group {list(group.ranks)}, though every TP rank holds it whole "
                "and applies the same summed gradient. Look for what updates it outside the step on some ranks (a "
                "hook, an optimizer or a kernel that is not deterministic, a checkpoint loaded on some ranks only).")
        at += f.numel()
