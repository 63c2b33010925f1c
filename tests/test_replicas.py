"""Replicas start equal, or the job refuses (gradsched.sync.replicas).

A data-parallel replica built from another seed (or initialized on meta from another init_seed, or compiled by
name) trains like the one-process reference: its values come from its stage's first replica. A replica built
with another structure (an extra layer, a parameter of another shape) is refused on every rank, naming the rank
and the first differing parameter, before anything is sent. The runs share one set of 4 gloo processes.
"""
import pytest
import torch

from gradsched.launch import run_ranks
from replica_fns import GPTConfig, cases, one_process_meta
from tied_training import Job, compare, gradient_error, reference

TOL = 1e-5
SEED = Job(pp=2, dp=2, steps=2, options={"compiler": "eager", "shard": "params"})  # broadcast before sharding
BY_NAME = Job(pp=1, dp=4, steps=2, options={"compiler": "eager", "shard": False})
EXTRA_LAYER = Job(pp=2, dp=2, steps=1)
OTHER_SHAPE = Job(pp=1, dp=4, steps=1)
RUNS = {
    # dp replica 1 (ranks 1 and 3, one per stage) built from another seed
    "seed": ("trained_with_odd_replicas", (SEED, {1, 3}, {"seed": 7})),
    # built on meta: rank 3 (stage 1, dp 1) initialized by an init_weights drawing from another seed
    "meta": ("meta_built_with_odd_init", (2, {3}, 2)),
    # torch.compile(backend="gradsched") at dp4: rank 2's model from another seed
    "by_name": ("by_backend_name", (BY_NAME, {2}, 7)),
    # make_replicas_equal alone on a module of several dtypes, a tie, non-contiguous and frozen tensors
    "mixed_pp1": ("mixed_tensors", (1,)),
    "mixed_pp2": ("mixed_tensors", (2,)),
    # refusals last (every rank raises at the same point, so the next run can still start)
    "extra_layer": ("trained_with_odd_replicas", (EXTRA_LAYER, {3}, {"config": GPTConfig(layers=3)})),
    "other_shape": ("trained_with_odd_replicas", (OTHER_SHAPE, {2}, {"config": GPTConfig(vocab=65)})),
}


@pytest.fixture(scope="module")
def runs():
    per_rank = run_ranks(cases, 4, list(RUNS.values()), timeout_s=300, collective_timeout_s=60)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(RUNS)}


def ok(ranks):
    errors = [r[1] for r in ranks if isinstance(r, tuple)]
    assert not errors, errors[0]
    return ranks


def test_a_replica_built_from_another_seed_trains_like_one_process_at_pp2_dp2(runs):
    ranks = ok(runs["seed"])
    ref = reference(SEED)
    assert gradient_error(ref, ranks) < TOL
    cmp = compare(ref, ranks)
    assert cmp["max_abs_diff"] < TOL and cmp["tied_bitwise_equal"] and not cmp["missing"]


def test_a_meta_built_replica_initialized_from_another_seed_trains_like_one_process(runs):
    want = one_process_meta(2)
    for r in ok(runs["meta"]):
        assert max((r["state"][k] - v).abs().max().item() for k, v in want.items()) < TOL


def test_a_replica_compiled_by_backend_name_from_another_seed_trains_like_one_process(runs):
    ranks = ok(runs["by_name"])
    ref = reference(BY_NAME)
    assert gradient_error(ref, ranks) < TOL
    assert compare(ref, ranks)["max_abs_diff"] < TOL


@pytest.mark.parametrize("pp", [1, 2])
def test_every_tensor_comes_from_its_stages_first_replica_in_one_broadcast_per_dtype(runs, pp):
    ranks = ok(runs[f"mixed_pp{pp}"])
    for r in ranks:
        first = ranks[r["stage"] * (4 // pp)]  # the stage's first replica: plan rank stage x dp
        assert all(torch.equal(v, first["state"][k]) for k, v in r["state"].items())
        assert r["tied"] and r["t_strides"] == (1, 2)  # ties kept, tensors changed in place
        # one all-gather of the structure digests over the plan, then one broadcast per dtype over the stage
        assert r["collectives"] == [("all_gather", 4, "int64", 4), ("broadcast", 3 * 3 + 3 + 3 + 8, "float32", 4 // pp),
                                    ("broadcast", 5, "bfloat16", 4 // pp), ("broadcast", 3, "int64", 4 // pp),
                                    ("broadcast", 6, "uint8", 4 // pp)]
    stages = [r["state"]["a.weight"] for r in ranks]
    assert pp == 1 or not torch.equal(stages[0], stages[-1])  # the stages' own values: not one broadcast


def refusal(ranks) -> str:
    assert all(isinstance(r, tuple) and r[0] == "error" for r in ranks), ranks
    messages = {r[1] for r in ranks}
    assert len(messages) == 1, messages  # the same refusal on every rank, stage 0's too
    msg = messages.pop()
    assert msg.startswith("ReplicaMismatch: ") and "nothing was sent, no step ran" in msg
    return msg


def test_a_replica_with_an_extra_layer_is_refused_on_every_rank_naming_it(runs):
    msg = refusal(runs["extra_layer"])
    assert "rank 3/4 (pp=1/2, dp=1/2, cp=0/1) differs from its stage's first replica, rank 2/4" in msg
    assert "parameter 'blocks.2.ln1.weight' (32,) float32 on rank 3, which rank 2 does not hold" in msg


def test_a_replica_with_a_parameter_of_another_shape_is_refused_on_every_rank_naming_it(runs):
    msg = refusal(runs["other_shape"])
    assert "rank 2/4 (pp=0/1, dp=2/4, cp=0/1) differs from its stage's first replica, rank 0/4" in msg
    assert "parameter 'wte.weight' (65, 32) float32 on rank 2, but parameter 'wte.weight' (64, 32) float32" in msg


def test_structure_differences_are_named_tie_order_and_dtype_included():
    from gradsched.sync.replicas import describe, first_difference
    a = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    b = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    b[1].weight = b[0].weight  # tied on one replica only

    def named(m):
        return [("parameter", n, p) for n, p in m.named_parameters(remove_duplicate=False)]
    assert first_difference(describe(named(b)), describe(named(a)), "rank 1", "rank 0") == \
        "parameter '1.weight' (2, 2) float32 (the tensor of '0.weight') on rank 1, but parameter '1.weight' " \
        "(2, 2) float32 on rank 0"
    assert "no parameter '1.bias' (2,) float32 on rank 1, which rank 0 holds" in first_difference(
        describe(named(a))[:3], describe(named(a)), "rank 1", "rank 0")
    wide = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).double()
    assert first_difference(describe(named(wide)), describe(named(a)), "rank 1", "rank 0").startswith(
        "parameter '0.weight' (2, 2) float64 on rank 1, but parameter '0.weight' (2, 2) float32 on rank 0")
