"""When one rank misbehaves: never silently wrong, never a silent hang, and the right rank named.

Multi-rank runs (gloo, 2 ranks) against one process; the pure parts (who is waited for, where values went
non-finite first, which boundary disagrees) in one process from fabricated statuses.
"""
import json
import math
import time

import pytest
import torch

from gradsched.launch import run_ranks
from gradsched.sync import nonfinite, peers, stuck
from gradsched.sync.boundaries import mismatch
from gradsched.sync.watchdog import is_comm_error
from misbehaving_fns import TIMEOUT_S, patient_peers, pipeline_misbehaviour, stuck_rank
from tied_training import Job, batch, build_model, compare, gradient_error, optimizer_class, optimizer_kwargs, reference
from tiny_gpt import lm_loss

TOL = 1e-5


# ---- alive but stuck, and stragglers ----------------------------------------------------------

def test_a_rank_stuck_in_python_is_named_with_its_stack_and_both_end():
    t0 = time.monotonic()
    peer, stuck_one = run_ranks(stuck_rank, 2, "python", timeout_s=90, raise_on_error=False)
    assert time.monotonic() - t0 < 60
    assert "rank 1 (pp=0/1, dp=1/2, cp=0/1) is alive but has issued no collective" in peer[1], peer[1]
    assert "outside gradsched (in the training script's own code)" in peer[1], peer[1]
    assert "in stuck_rank" in peer[1] and "Rank 1's stack" in peer[1]  # the stuck rank's own Python stack
    assert "is the rank the job waits for: rank 0 found it" in stuck_one[1], stuck_one[1]


def test_a_straggler_beyond_the_timeout_is_named_and_does_not_blame_its_peer():
    peer, late = run_ranks(stuck_rank, 2, "late", timeout_s=90, raise_on_error=False)
    assert "rank 1 (pp=0/1, dp=1/2, cp=0/1) is alive but has issued no collective" in peer[1], peer[1]
    assert "'the optimizer's parameter all-gather, bucket 0'" in peer[1] and "in late" in peer[1]
    assert "is the rank the job waits for" in late[1] and "issued another number" not in late[1], late[1]


def test_a_straggler_within_the_timeout_and_a_long_compile_are_no_faults_and_train_like_one_process():
    ranks = run_ranks(patient_peers, 2, timeout_s=120)
    job = Job(pp=1, dp=2, steps=2)
    ref = reference(job)
    assert gradient_error(ref, ranks) < TOL
    assert compare(ref, ranks)["max_abs_diff"] < TOL


# ---- pipelines: shapes named at their source, non-finite values never applied ----------------------

@pytest.fixture(scope="module")
def pipeline_runs():
    return run_ranks(pipeline_misbehaviour, 2, timeout_s=180)


def test_a_batch_of_another_shape_is_refused_on_every_rank_naming_its_sender(pipeline_runs):
    for r in pipeline_runs:
        assert r["shape"].startswith("PlanError: pipeline stages disagree before the first send: rank 0 (stage 0, "
                                     "dp=0, cp=0) would send [8, 12, 32] float32 to rank 1 (stage 1), which was "
                                     "built to receive [8, 16, 32] float32"), r["shape"]


def test_a_nan_sent_by_one_stage_raises_on_every_rank_naming_it_and_the_step(pipeline_runs):
    for r in pipeline_runs:
        assert r["raise"].startswith("NonFiniteError: step 2 (of this run): rank 0 (pipeline stage 0) went "
                                     "non-finite first, in its stage's forward output"), r["raise"]


def test_a_nan_that_appears_in_transit_is_named_at_the_boundary_not_blamed_on_the_receivers_loss(pipeline_runs):
    for r in pipeline_runs:
        assert r["transit"].startswith("NonFiniteError: step 2 (of this run): rank 1 received a non-finite "
                                       "activation from rank 0 (stage 0 -> 1, micro-batch 1) whose own output "
                                       "was finite"), r["transit"]


def test_a_global_batch_without_a_labelled_token_is_a_non_finite_loss_never_applied(pipeline_runs):
    for r in pipeline_runs:  # its mean loss is 0/0, as in one process; found with the step's one read, no other
        assert r["unlabelled"].startswith("NonFiniteError: step 2 (of this run): rank 1 (pipeline stage 1) went "
                                          "non-finite first, in its loss"), r["unlabelled"]


def one_process_skipping_step_2(job: Job) -> dict:
    """The unsplit model's parameters after job.steps steps on the global batch, the second step not applied."""
    model, _ = build_model(job)
    opt = optimizer_class(job)(model.parameters(), **optimizer_kwargs(job))
    for step in range(job.steps):
        x, y = batch(job, step)
        lm_loss(model(x), y).backward()
        if step != 1:
            opt.step()
        opt.zero_grad()
    ref = {"params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
           "aliases": []}
    return ref


def test_skip_drops_the_step_on_every_rank_and_ends_like_one_process_that_skipped_it(pipeline_runs):
    ref = one_process_skipping_step_2(Job(pp=2, dp=1, steps=3))
    runs = [r["skip"] for r in pipeline_runs]
    assert [r["skipped"] for r in runs] == [1, 1]
    cmp = compare(ref, runs)
    assert cmp["max_abs_diff"] < TOL and cmp["tied_bitwise_equal"]


@pytest.mark.parametrize("shard, early", [("False", True), ("True", True), ("True fp16", False)])
def test_a_nan_in_one_ranks_gradients_under_a_finite_loss_raises_on_every_rank(pipeline_runs, shard, early):
    """shard=False and shard=True gather the step's row before the last backward and add each rank's own
    reduced-gradient flag: the same on every rank (all-reduced buckets; or a bucket with a non-finite element made
    NaN throughout before its reduce-scatter, so every rank's shard of it is NaN). fp16 buckets, whose finite sums
    can overflow on one shard alone, gather the flags of every rank's shards after the reduction."""
    for r in pipeline_runs:
        run = r[f"grads shard={shard}"]
        assert run["early"] is early
        assert run["error"] is not None and run["error"].startswith("NonFiniteError: step 2 (of this run): "), run
        assert "its reduced gradients" in run["error"], run["error"]


def test_a_plain_torch_optimizer_under_shard_false_never_applies_a_non_finite_gradient(pipeline_runs):
    """shard=False with the user's own torch optimizer over model.parameters(): its step() asks the step's verdict
    first, as DistributedOptimizer's does (NaN parameters before)."""
    for r in pipeline_runs:
        run = r["grads plain raise"]
        assert run["error"] is not None and run["error"].startswith("NonFiniteError: step 2 (of this run): "), run
        assert "Nothing was applied" in run["error"]
        by_name = r["by name plain raise"]  # compiled by backend name: the same hook
        assert by_name is not None and by_name.startswith("NonFiniteError: step 2 (of this run): "), by_name


def test_plain_torch_optimizers_skip_a_non_finite_step_on_every_rank_under_on_nonfinite_skip(pipeline_runs):
    """on_nonfinite="skip": the step's gradients are dropped, so neither of two optimizers (the embedding's and the
    rest's) applies anything (no weight decay either); the parameters equal one process that skipped that step,
    and the second optimizer asks no collective of its own (ranks stepping other optimizers would not join it)."""
    ref = one_process_skipping_step_2(Job(pp=1, dp=2, steps=3))
    runs = [r["grads plain skip"] for r in pipeline_runs]
    assert all(run["error"] is None for run in runs), runs
    assert all(run["flag_gathers"] == 0 for run in runs), [run["flag_gathers"] for run in runs]
    assert all(run["skipped"] == 1 for run in runs), [run["skipped"] for run in runs]  # counted once, not per optimizer
    cmp = compare(ref, runs)
    assert cmp["max_abs_diff"] < TOL and cmp["tied_bitwise_equal"]


# ---- the pure parts --------------------------------------------------------------------------

def _agreed(rows, nan_flags=False):
    """[world, SLOTS] from {rank: (stage, {kind, ...})}, as the step's gather leaves them: a bad loss is a non-finite
    loss share (its rank's row holds no loss flag); a flag is any nonzero (the step sets NaN: nan_flags)."""
    out = torch.zeros(len(rows), nonfinite.SLOTS, dtype=torch.float64)
    for r, (stage, kinds) in rows.items():
        out[r, 0] = stage + 1
        for k in kinds:
            if k == nonfinite.LOSS:
                out[r, nonfinite.SHARE] = float("nan")
            else:
                out[r, k] = float("nan") if nan_flags else 1
    return out


def test_non_finite_values_are_traced_to_the_lowest_stage_forward_then_the_loss_then_the_last_backward():
    F, L, B, G = nonfinite.FORWARD, nonfinite.LOSS, nonfinite.BACKWARD, nonfinite.GRADS
    # everything downstream of stage 1's forward went bad too: the origin is stage 1's forward, rank 3
    rows = {0: (0, {G}), 1: (0, {B, G}), 2: (0, {G}), 3: (1, {F, B, G}), 4: (2, {L, B, G}), 5: (2, {G})}
    assert "rank 3 (pipeline stage 1) went non-finite first, in its stage's forward output" in \
        nonfinite.describe(_agreed(rows), 7)
    rows = {0: (0, {B, G}), 1: (1, {B, G}), 2: (2, {L, B, G}), 3: (2, {G})}
    assert "rank 2 (pipeline stage 2) went non-finite first, in its loss" in nonfinite.describe(_agreed(rows), 1)
    rows = {0: (0, {B, G}), 1: (1, {B, G}), 2: (1, {G})}  # an overflow in stage 1's backward
    assert "rank 1 (pipeline stage 1) went non-finite first, in its stage's input gradients" in \
        nonfinite.describe(_agreed(rows), 1)
    assert "step 4 (of this run): rank 1 (pipeline stage 0) went non-finite first, in its reduced gradients" in \
        nonfinite.describe(_agreed({0: (0, set()), 1: (0, {G})}), 4)


def test_a_receipt_gone_non_finite_is_named_at_its_boundary_only_when_its_senders_output_was_finite():
    F, L, B = nonfinite.FORWARD, nonfinite.LOSS, nonfinite.BACKWARD
    rows = _agreed({0: (0, {B}), 1: (1, {L, B}), 2: (2, {L})})
    rows[:, nonfinite.RECEIVED_AT] = -1
    for r, microbatch in ((2, 0), (1, 3)):  # two receipts went bad: the lower stage's is named
        rows[r, nonfinite.RECEIVED] = float("nan")
        rows[r, nonfinite.RECEIVED_AT] = nonfinite.transit_code(r, microbatch, r - 1)
    assert "rank 1 received a non-finite activation from rank 0 (stage 0 -> 1, micro-batch 3) whose own output " \
        "was finite; non-finite values were seen on rank(s) [0, 1, 2]" in nonfinite.describe(rows, 5)
    rows[0, F] = float("nan")  # the sender's own output went non-finite: the model's, named as before
    assert "rank 0 (pipeline stage 0) went non-finite first, in its stage's forward output" in \
        nonfinite.describe(rows, 5)


def test_a_stages_received_row_is_finite_and_minus_one_until_a_receipt_goes_non_finite():
    flags = nonfinite.StepFlags()
    assert flags.received_row("cpu").tolist() == [0.0, -1.0]
    flags.observe_received(nonfinite.transit_code(1, 0, 0), (torch.ones(3), torch.tensor([1, 2])))
    flags.observe_received(nonfinite.transit_code(1, 2, 0), torch.tensor([1.0, float("inf")]))
    flags.observe_received(nonfinite.transit_code(1, 1, 0), torch.tensor([float("nan")]))
    flag, at = flags.received_row("cpu").tolist()
    assert math.isnan(flag) and nonfinite.transit_of(int(at)) == (1, 1, 0)
    flags.reset()
    assert not flags.observed()


def test_a_nan_global_loss_blames_the_rank_whose_loss_went_bad_or_else_the_whole_last_stage():
    L = nonfinite.LOSS
    # rank 3's own loss share went NaN: rank 3 is named, not the lowest rank of the last stage
    assert "rank 3 (pipeline stage 1) went non-finite first, in its loss" in nonfinite.describe(
        _agreed({0: (0, set()), 1: (0, set()), 2: (1, set()), 3: (1, {L})}), 1, loss_bad=True)
    # no rank's share went bad (no labelled token anywhere: 0/0): the last stage's ranks, the lowest first
    assert "rank 2 (pipeline stage 1) went non-finite first, in its loss; non-finite values were seen on rank(s) " \
        "[2, 3]" in nonfinite.describe(_agreed({0: (0, set()), 1: (0, set()), 2: (1, set()), 3: (1, set())}), 1,
                                       loss_bad=True)


def test_the_steps_one_read_sees_a_flag_a_loss_share_the_loss_or_the_ranks_own_gradients_go_non_finite():
    from types import SimpleNamespace

    def applied(agreed, loss=None, own=None):
        flags = nonfinite.StepFlags()
        flags.agreed, flags.loss, flags.own_grads = agreed, loss, own
        try:
            return nonfinite.check(SimpleNamespace(nonfinite=flags), "raise")
        except nonfinite.NonFiniteError as e:
            return str(e)
    ok = _agreed({0: (0, set()), 1: (1, set())})
    ok[:, nonfinite.COUNT] = 1e12  # large finite counts and scales stay finite
    ok[:, nonfinite.SCALE] = 1e12
    assert applied(ok, torch.tensor(3.0, dtype=torch.float64), torch.tensor(1e30, dtype=torch.float64)) is True
    for kind in (nonfinite.FORWARD, nonfinite.LOSS, nonfinite.BACKWARD, nonfinite.GRADS):
        assert "rank 1 (pipeline stage 1) went non-finite first, in " + nonfinite.WHAT[kind] in applied(
            _agreed({0: (0, set()), 1: (1, {kind})}, nan_flags=True))
    assert "in its loss" in applied(ok, torch.tensor(float("nan"), dtype=torch.float64))
    said = applied(ok, None, torch.tensor(float("inf"), dtype=torch.float64))  # reduced alike: every rank's
    assert "rank 0 (pipeline stage 0) went non-finite first, in its reduced gradients" in said and "[0, 1]" in said


def test_step_flags_see_nan_and_inf_and_nothing_while_paused():
    flags = nonfinite.StepFlags()
    set_ = lambda: [x != 0 for x in flags.bad("cpu").tolist()]  # noqa: E731 - a flag is its nonzero (NaN)
    flags.observe(nonfinite.LOSS, torch.tensor(1.0))
    with flags.paused():  # pipelining's shape inference on empty tensors
        flags.observe(nonfinite.FORWARD, torch.tensor([float("nan")]))
    assert set_() == [False, False, False, False]
    flags.observe(nonfinite.BACKWARD, (torch.ones(3), torch.tensor([1.0, float("inf")])))
    assert set_() == [False, False, True, False]
    # the largest finite values, in their own dtypes, many of them: still finite (a sum would overflow)
    flags.observe(nonfinite.FORWARD, (torch.full((1000,), torch.finfo(torch.float32).max),
                                      torch.full((1000,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)))
    flags.observe(nonfinite.FORWARD, torch.full((4,), torch.finfo(torch.float64).max, dtype=torch.float64))
    flags.observe(nonfinite.FORWARD, torch.tensor([torch.finfo(torch.float16).min, 0.0], dtype=torch.float16))
    flags.observe(nonfinite.LOSS, torch.tensor([1.0, float("-inf")]))
    assert set_() == [False, True, True, False]


def test_reduced_gradients_are_bad_exactly_when_an_element_is_not_finite_in_their_own_dtype():
    from types import SimpleNamespace
    def bad(*grads):
        sync = SimpleNamespace(sync_plan=SimpleNamespace(layout=SimpleNamespace(buckets=grads)), reduced=lambda: list(grads))
        return not torch.isfinite(nonfinite.reduced_gradients_marker(sync, "cpu")).item()
    big = torch.finfo(torch.float64).max
    assert bad(torch.tensor([1.0, -2.0]), torch.tensor([big, -big], dtype=torch.float64)) == 0  # finite in fp64
    assert bad(torch.tensor([1.0, float("nan")]), torch.zeros(3)) == 1
    assert bad(torch.zeros(2, dtype=torch.bfloat16), torch.tensor([-float("inf")], dtype=torch.float64)) == 1
    assert bad(torch.tensor([torch.finfo(torch.float16).max], dtype=torch.float16)) == 0
    # many of the largest finite values: a sum in their own dtype would overflow
    assert bad(torch.full((1000,), torch.finfo(torch.float32).max),
               torch.full((1000,), torch.finfo(torch.float16).max, dtype=torch.float16)) == 0
    assert bad(torch.full((1000,), big, dtype=torch.float64)) == 0


def test_boundaries_name_the_sender_of_the_first_disagreeing_boundary():
    ok = {"inputs": [((4, 16, 32), "float32")], "outputs": [((4, 16, 32), "float32")]}
    short = {"inputs": [((4, 12), "int64")], "outputs": [((4, 12, 32), "float32")]}
    every = [(0, (0, 0, 0), ok), (1, (0, 1, 0), short), (2, (1, 0, 0), ok), (3, (1, 1, 0), ok)]
    text = mismatch(every, 2)
    assert text.startswith("pipeline stages disagree before the first send: rank 1 (stage 0, dp=1, cp=0) would "
                           "send [4, 12, 32] float32 to rank 3 (stage 1)"), text
    assert mismatch([every[0], every[2]], 2) is None


def test_a_transport_error_wrapped_by_pipelining_is_a_transport_error():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
        except RuntimeError as e:
            raise RuntimeError("Failed to run stage backward:") from e
    except RuntimeError as wrapped:
        assert is_comm_error(wrapped)
    assert not is_comm_error(RuntimeError("shape '[4, 16, 4, 8]' is invalid for input of size 1536"))


class _Store:
    def __init__(self, statuses):
        self.d = {f"gradsched/status/{r}": json.dumps(s).encode() for r, s in statuses.items()}

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, key):
        return self.d[key]

    def set(self, key, value):
        self.d[key] = value.encode() if isinstance(value, str) else value


class _Journal:
    def __init__(self, statuses):
        import threading
        self.store, self.lock, self.seen = _Store(statuses), threading.Lock(), {}


def _status(rank, counts, idle_s, **extra):
    return {"beat": 1, "pid": 1, "host": "h", "host_id": "elsewhere", "where": f"rank {rank}/4 (pp=0/1, dp={rank}/4, "
            "cp=0/1)", "counts": counts, "idle_s": idle_s, "open": None, **extra}


def test_the_rank_everybody_waits_for_is_found_through_waiting_ranks():
    # rank 0 waits for rank 1 on group a; rank 1 waits for rank 2 on group b; rank 2 waits for nobody, idle 40 s
    st = {0: _status(0, [["a", [0, 1], 5]], 35), 1: _status(1, [["a", [0, 1], 4], ["b", [1, 2], 7]], 35),
          2: _status(2, [["b", [1, 2], 6]], 40, last={"what": "train_step 3", "state": "completed"}, last_age_s=40)}
    j = _Journal(st)
    text, ranks = stuck.find(j, 0, st[0], timeout_s=30, compile_timeout_s=600)
    assert ranks == [2]
    assert text.startswith("rank 2 (pp=0/1, dp=2/4, cp=0/1) is alive but has issued no collective for 40 s while "
                           "rank 1 waits for it on group [1, 2] (this rank waits for it through rank(s) [1])"), text
    assert "since 'train_step 3' completed 40 s ago" in text


def test_a_rank_that_is_compiling_is_given_the_compile_timeout():
    st = {0: _status(0, [["a", [0, 1], 5]], 35), 1: _status(1, [["a", [0, 1], 4]], 100, patient=True)}
    assert stuck.find(_Journal(st), 0, st[0], timeout_s=30, compile_timeout_s=600) is None
    st[1]["idle_s"] = 700
    assert stuck.find(_Journal(st), 0, st[0], timeout_s=30, compile_timeout_s=600)[1] == [1]


def test_nobody_is_named_while_counts_agree():
    st = {0: _status(0, [["a", [0, 1], 5]], 35), 1: _status(1, [["a", [0, 1], 5]], 35)}
    assert stuck.find(_Journal(st), 0, st[0], timeout_s=30, compile_timeout_s=600) is None


def test_a_peer_that_left_is_said_with_its_last_entry_not_a_stale_heartbeat():
    st = _status(1, [], 0, last={"what": "train_step 2", "state": "completed"}, host_id=peers.HOST_ID, pid=2 ** 22 + 7)
    assert "its last entry, 'train_step 2', had completed" in peers.state(_Journal({}), 1, st)
