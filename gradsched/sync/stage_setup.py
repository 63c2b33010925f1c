"""StageSetup: what one stage's gradient sync is given before any graph exists, as plain data.

Built once per stage by `setup_stage`, the only place here that creates
process groups (every rank creates every tie's group, in tie-key order:
`new_group` is itself a collective). Everything after it (planning, the
passes, the checks, the executor, the report, the optimizer) is handed this
record and the SyncPlan, and names groups by `Group` (process-group name,
ranks, this rank's index), as the collectives in the graphs do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from gradsched.options import SyncOptions
from gradsched.plan import ParallelPlan
from gradsched.sync.sync_plan import Group
from gradsched.sync.ties import Tie
from gradsched.sync.watchdog import register_group


@dataclass(frozen=True)
class StageSetup:
    stage: int
    rank: int
    where: str  # the plan's coordinates of this rank, for messages and the report
    placement: str  # resolved: "tied_at_flush" | "backward" | "flush"
    grad_group: Group  # the stage's dp x cp ranks: gradients are reduced here
    all_ranks: Group  # every rank of the plan: a global gradient norm is summed here
    tie_groups: dict  # tie key -> Group summing this stage's copy with the other stages'
    ties: dict  # this stage's tied parameter name -> Tie
    aliases: tuple  # frozensets of names of one Parameter in the unsplit model
    tp_group: Group | None = None  # tp > 1: the ranks splitting this stage's layers (gradsched/tp)


def resolve_placement(placement: str, pp: int, has_ties: bool) -> str:
    """auto: 'backward' at pp=1 (the reductions overlap the backward), 'tied_at_flush' at pp > 1. 'backward'
    with a tie across stages is refused: a stage's backward would wait on another stage before
    sending its input gradient, which deadlocks."""
    if placement == "auto":
        placement = "backward" if pp == 1 else "tied_at_flush"
    if placement == "backward" and has_ties:
        raise ValueError(
            "placement='backward' with weights tied across pipeline stages would deadlock: a stage's "
            "backward would wait on the other stage before sending its input gradient. Use "
            "placement='tied_at_flush' (the default for pp > 1: only the tied buckets wait for the flush) or 'flush'.")
    return placement


def group(ranks, pg, rank: int) -> Group:
    return Group(pg.group_name, tuple(ranks), list(ranks).index(rank))


def setup_stage(plan: ParallelPlan, options: SyncOptions, ties: list[Tie] = (), aliases=(),
                stage: int | None = None) -> StageSetup:
    stage = plan.stage if stage is None else stage
    rank = plan.rank
    all_ties = sorted(ties, key=lambda t: t.key)
    # every rank, every tie, one order; None on a rank outside the tie (a middle stage at pp > 2)
    groups = {t.key: plan.tie_group(t.stages) for t in all_ties}
    if dist.is_initialized():  # the watchdog publishes what this rank has issued on each (gradsched.sync.stuck)
        for pg in [plan.group or dist.group.WORLD, *(plan.process_group(k) for k in ("grad", "dp", "cp", "pp", "tp")),
                   *(groups[t.key][1] for t in all_ties if groups[t.key] is not None)]:
            register_group(pg)
    mine = {t.name_on(stage): t for t in all_ties if t.name_on(stage)}
    return StageSetup(
        stage=stage, rank=rank, where=plan.describe(),
        placement=resolve_placement(options.placement, plan.pp, bool(mine)),
        grad_group=group(plan.group_ranks("grad"), plan.process_group("grad"), rank),
        all_ranks=group(range(plan.world), plan.group or dist.group.WORLD, rank),
        tie_groups={t.key: group(*groups[t.key], rank) for t in mine.values()},
        ties=mine, aliases=tuple(frozenset(a) for a in aliases),
        tp_group=group(plan.group_ranks("tp"), plan.process_group("tp"), rank) if plan.tp > 1 else None)


def process_group(g: Group):
    """The process group a Group names (created by ParallelPlan, looked up by its name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(g.name)
