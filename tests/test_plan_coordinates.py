"""A plan's named coordinates against the rank layout written out by hand: tensor fastest, then context, data,
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


TP_PLAN = gradsched.ParallelPlan(pp=2, dp=2, cp=2, tp=2)


def tp_layout():
    """(rank, pp, dp, cp, tp index), enumerated with tp fastest, then cp, dp, pp (Megatron's order)."""
    ranks = itertools.count()
    return [(next(ranks), p, d, c, t) for p in range(2) for d in range(2) for c in range(2) for t in range(2)]


def test_tensor_parallel_ranks_are_the_fastest_coordinate():
    for rank, p, d, c, t in tp_layout():
        assert TP_PLAN.coords(rank) == (p, d, c, t) and TP_PLAN.rank_of(p, d, c, t) == rank


def test_the_first_replica_is_per_tensor_parallel_index():
    # every TP rank holds its own shard of the stage: its replicas are the ranks with the same TP index
    for rank, p, _, _, t in tp_layout():
        first = TP_PLAN.first_replica(rank)
        assert TP_PLAN.coords(first) == (p, 0, 0, t)


def test_each_group_kind_holds_the_ranks_that_differ_only_in_its_dimensions():
    layouts = dict(TP_PLAN._layouts())
    differ = {"grad": {1, 2}, "dp": {1}, "cp": {2}, "pp": {0}, "tp": {3}}
    for kind, dims in differ.items():
        groups = layouts[kind]
        assert sorted(r for g in groups for r in g) == list(range(TP_PLAN.world)), kind  # a partition of the ranks
        for g in groups:
            coords = [TP_PLAN.coords(r) for r in g]
            assert all(a[i] == coords[0][i] for a in coords for i in range(4) if i not in dims), (kind, g)
            assert len(g) == {"grad": 4, "dp": 2, "cp": 2, "pp": 2, "tp": 2}[kind]


def test_a_plan_without_tensor_parallelism_lays_ranks_out_as_before():
    assert all(PLAN.coords(r)[:3] == (p, d, c) and PLAN.index("tp", r) == 0 for r, p, d, c in layout())


def test_sizes_that_tp_does_not_divide_are_refused_before_connecting():
    import pytest
    from gradsched.plan import PlanError, plan_sizes
    assert plan_sizes(8, pp=2, tp=2) == 2
    with pytest.raises(PlanError, match="tp=4 does not divide the world size 6"):
        plan_sizes(6, tp=4)
