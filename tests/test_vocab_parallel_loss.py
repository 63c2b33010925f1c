"""The loss after a pipeline's last stage under tensor parallelism (gradsched.training.vocab_parallel_loss).

Each TP rank holds its vocabulary columns of the logits; the loss must equal what one process computes on the
whole logits, in float64, to the last bits: label smoothing over the whole vocabulary, ignored targets and the
step's weighting included. A loss no rank can compute from its columns alone still trains, on gathered logits,
and says so.
"""
import pytest

from gradsched.launch import run_ranks
from vocab_parallel_loss_fns import LOSSES, cases

EXACT = 1e-15


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(cases, 2, list(LOSSES), timeout_s=600)


def test_a_smoothed_summed_loss_with_ignored_targets_is_one_process_s_without_gathering_the_logits(ranks):
    for r in ranks:
        got = r["smoothed"]
        assert got["split"] == [(2, 8, 16)], got["split"]  # compiled loss-parallel over 16 of the 32 columns
        assert got["loss"] < EXACT and got["grad"] < EXACT, got
        assert not got["warnings"], got["warnings"]


def test_a_loss_that_reads_every_column_trains_on_gathered_logits_and_says_why(ranks):
    for r in ranks:
        got = r["z_loss"]
        assert got["split"] == [], "a z-loss cannot run on one rank's columns"
        assert got["loss"] < EXACT and got["grad"] < EXACT, got
        assert len(got["warnings"]) == 1 and "logsumexp" in got["warnings"][0] and "gathered" in got["warnings"][0], \
            got["warnings"]
