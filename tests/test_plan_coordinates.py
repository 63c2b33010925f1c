"""A plan's named coordinates against the rank layout written out by hand: context fastest, then data, then
pipeline (sizes only: no process group is touched)."""
import itertools

import gradsched

PLAN = gradsched.ParallelPlan(pp=2, dp=3, cp=2)


def layout():
    """(rank, pp index, dp index, cp index), enumerated with cp fastest."""
    ranks = itertools.count()
    return [(next(ranks), p, d, c) for p in range(PLAN.pp) for d in range(PLAN.dp) for c in range(PLAN.cp)]


def test_each_rank_s_coordinate_is_asked_for_by_name():
    for rank, p, d, c in layout():
        assert (PLAN.index("pp", rank), PLAN.index("dp", rank), PLAN.index("cp", rank)) == (p, d, c)


def test_the_first_replica_of_a_stage_is_its_dp0_cp0_rank():
    firsts = {p: rank for rank, p, d, c in layout() if d == 0 and c == 0}
    for rank, p, _, _ in layout():
        assert PLAN.first_replica(rank) == firsts[p]


def test_a_stage_is_held_by_dp_times_cp_replicas():
    assert PLAN.stage_replicas == sum(1 for _, p, _, _ in layout() if p == 0) == 6
