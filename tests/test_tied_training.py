"""Training the tied GPT under each layout matches the unsplit model trained in one process.

Each test spawns gloo processes (gradsched.launch kills any that outlive it) and
compares every parameter after 3 AdamW steps with the single-process reference.
tests/test_option_matrix.py compares gradients for every option and layout.
"""
import pytest

from gradsched.launch import RankFailed, run_ranks
from gradsched.tied_training import Job, compare, rank_main, reference

TOL = 1e-5


def train(job: Job):
    ranks = run_ranks(rank_main, job.world, job, timeout_s=300)
    ref = reference(job)
    return ref, ranks, compare(ref, ranks)


def assert_matches_reference(ref, ranks, cmp):
    assert cmp["missing"] == [] and cmp["uncovered"] == []
    assert cmp["max_abs_diff"] < TOL
    assert cmp["tied_bitwise_equal"]
    last = [r for r in ranks if r["losses"][0] is not None]
    for step, want in enumerate(ref["losses"]):
        got = sum(r["losses"][step] for r in last) / len(last)
        assert abs(got - want) <= TOL * abs(want)


def test_pp2_dp2_matches_the_single_process_reference():
    ref, ranks, cmp = train(Job(pp=2, dp=2))
    assert_matches_reference(ref, ranks, cmp)
    assert all(r["verifier"] == "ok" for r in ranks)
    # the tie was found from the split, not declared
    assert ranks[0]["ties"] == [((0, "wte.weight"), (1, "lm_head.weight"))]


def test_dp4_without_pipeline_matches_the_reference_and_needs_no_tie_group():
    ref, ranks, cmp = train(Job(pp=1, dp=4))
    assert_matches_reference(ref, ranks, cmp)
    assert ranks[0]["ties"] == [] and ranks[0]["tied_bytes_per_step"] == 0
    assert ranks[0]["within_module_ties"] == [["wte.weight", "lm_head.weight"]]


def test_shard_aligned_matches_the_reference_with_dp_times_fewer_tied_bytes():
    _, first, _ = train(Job(pp=2, dp=2))
    ref, ranks, cmp = train(Job(pp=2, dp=2, options={"compiler": "eager", "mode": "shard_aligned"}))
    assert_matches_reference(ref, ranks, cmp)
    assert all(r["verifier"] == "ok" for r in ranks)
    for a, b in zip(first, ranks):
        assert b["tied_bytes_per_step"] * 2 == a["tied_bytes_per_step"] > 0


def test_reduce_scatter_first_at_different_offsets_is_refused_with_the_parameters_named():
    with pytest.raises(RankFailed) as err:
        run_ranks(rank_main, 4, Job(pp=2, dp=2, options={"compiler": "eager", "mode": "unsafe_rs_first"}),
                  timeout_s=300)
    msg = str(err.value)
    assert "TiedGradientHazard" in msg and "'wte.weight'" in msg and "'lm_head.weight'" in msg
    assert "offset" in msg and "#844" in msg


def test_reduce_scatter_first_at_different_offsets_gives_wrong_gradients():
    job = Job(pp=2, dp=2, options={"compiler": "eager", "mode": "unsafe_rs_first", "allow_hazard": True})
    ref, ranks, cmp = train(job)
    assert all(r["verifier"] == "hazard" for r in ranks)
    assert cmp["max_abs_diff"] > 1e-3
    assert not cmp["tied_bitwise_equal"]
