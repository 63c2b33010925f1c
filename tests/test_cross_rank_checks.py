"""Ranks that would issue different collectives fail fast and readably instead of hanging."""
import time

import pytest

from gradsched.sync.fingerprint import CollectiveMismatch, compare_sequences
from gradsched.launch import RankFailed, run_ranks
from tied_training import Job, rank_main


def test_ranks_compiling_different_collective_orders_raise_within_seconds():
    job = Job(pp=1, dp=2, steps=1, rank_options={1: {"compiler": "eager", "bucket_mb": 0.01}})
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run_ranks(rank_main, 2, job, timeout_s=120, collective_timeout_s=600)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert "2 of 2 ranks failed" in msg and msg.count("CollectiveMismatch") >= 2
    assert "collectives differ on the gradient group" in msg and "at collective #0" in msg
    assert "reduce_scatter of bucket [" in msg  # what each side issues, by identity
    # far below the 600 s collective timeout: the fingerprint exchange caught it, no hang
    assert elapsed < 60


def test_tied_copies_with_different_shapes_are_rejected_by_name():
    # a wrong declaration: the embedding (64 x 32) "tied" to a bias (128)
    job = Job(pp=2, dp=1, steps=1, ties=[{0: "wte.weight", 1: "blocks.1.fc.bias"}])
    with pytest.raises(RankFailed) as err:
        run_ranks(rank_main, 2, job, timeout_s=120)
    msg = str(err.value)
    assert "tied copies differ" in msg and "(64, 32)" in msg and "(128,)" in msg


def test_equal_sized_collectives_of_different_ties_are_told_apart_and_both_named():
    tie_a = ("all_reduce", "torch.float32", 1024, '"tie 0:wte.weight~1:lm_head.weight"')
    tie_b = ("all_reduce", "torch.float32", 1024, '"tie 0:blocks.0.proj.weight~1:blocks.1.proj.weight"')
    with pytest.raises(CollectiveMismatch) as err:
        compare_sequences("tie group", (0, 2), 0, [tie_a, tie_b], 2, [tie_b, tie_a])
    msg = str(err.value)
    assert "at collective #0 rank 0 issues all_reduce of tie 0:wte.weight~1:lm_head.weight" in msg
    assert "rank 2 issues all_reduce of tie 0:blocks.0.proj.weight~1:blocks.1.proj.weight" in msg
