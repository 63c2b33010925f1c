"""The two sub-groups of a context-parallel group that comm="hybrid" runs over.

With an all-to-all degree a (cp = a * r), the CP group's ranks (numbered by their index in it)
form r all-to-all groups of a consecutive ranks, {j*a, ..., j*a + a - 1}, and a ring groups
{m, a + m, 2a + m, ...}: the all-to-all stays among neighbouring ranks (inside a node, where
it is cheap) and the ring crosses the rest. CP rank j*a + m is rank m of its all-to-all group
and rank j of its ring.

Only the CP group's own ranks create these groups (`use_local_synchronization`), each its
all-to-all group first and its ring group second, at the first attention call (or while it is
traced): every rank of a CP group reaches it together, and ranks of other CP groups (data or
pipeline parallel) never have to. The names are cached per process.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def split_ranks(cp: int, a2a: int) -> tuple[list[list[int]], list[list[int]]]:
    """(all-to-all groups, ring groups) as lists of CP-group indices."""
    r = cp // a2a
    return ([[j * a2a + m for m in range(a2a)] for j in range(r)],
            [[j * a2a + m for j in range(r)] for m in range(a2a)])


@functools.cache
def _create(group_name: str, a2a: int) -> tuple[str, str]:
    pg = dist.distributed_c10d._resolve_process_group(group_name)
    members = dist.get_process_group_ranks(pg)  # global ranks, by CP index
    me = dist.get_rank(pg)
    a2a_groups, ring_groups = split_ranks(len(members), a2a)
    names = []
    for groups in (a2a_groups, ring_groups):
        mine = next(g for g in groups if me in g)
        sub = dist.new_group([members[i] for i in mine], use_local_synchronization=True)
        names.append(sub.group_name)
    return names[0], names[1]


@torch.compiler.assume_constant_result
def hybrid_groups(group_name: str, a2a: int) -> tuple[str, str]:
    """(all-to-all group name, ring group name) of this rank for the CP group `group_name`."""
    return _create(group_name, a2a)
