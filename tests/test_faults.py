"""A fault on one rank ends as an error on every other, naming the rank, the collective and the trace.

pp1 x dp2, eager: rank 1 fails inside the optimizer's parameter all-gather of the first step. Without
the watchdog the killed and raising cases end in gloo's "Connection closed by peer" (no rank named),
and the extra collective hangs until gloo's timeout (the launcher's 60 s here, 30 minutes by default).
"""
import time

from gradsched.launch import run_ranks
from rank_fns import fault_in_the_optimizers_gather

TIMEOUT_S = 3.0  # fault_timeout_s: how long a collective may wait with every peer alive and waiting


def run(fault: str, deadline_s: float = 120) -> tuple[list, float]:
    t0 = time.monotonic()
    ranks = run_ranks(fault_in_the_optimizers_gather, 2, fault, TIMEOUT_S, timeout_s=deadline_s, raise_on_error=False)
    return ranks, time.monotonic() - t0


def test_a_killed_rank_is_named_by_its_peer_with_the_collective_it_waited_in():
    (peer, killed), _ = run("killed")
    assert killed[1] == "rank 1 exited with code -9 without a result"
    assert peer[1].startswith("CollectiveFault: rank 0/2"), peer[1]
    assert "all_gather 'the optimizer's parameter all-gather, bucket 0' over ranks [0, 1]" in peer[1]
    assert "rank 1 (pp=0/1, dp=1/2, cp=0/1) is gone (process" in peer[1]
    assert "#" in peer[1].split("last entries:")[1]  # the trace of this rank's collectives


def test_a_rank_that_stops_answering_is_named_by_its_neighbour_and_its_peer_ends():
    # SIGSTOP: alive, silent; gloo would wait for it 30 minutes. Its neighbour (rank 0) sees its heartbeat stop
    # (3 s here, 10 s by default), posts it, and rank 0, still blocked on it 2 s later (5 s), ends with the report;
    # the launcher kills rank 1 at its deadline
    (peer, stopped), _ = run("stopped", deadline_s=15)
    assert stopped[1] == "rank 1 timed out without a result"
    assert peer[1].startswith("CollectiveFault: rank 0/2 (pp=0/1, dp=0/2, cp=0/1) has waited in all_gather 'the "
                              "optimizer's parameter all-gather, bucket 0'"), peer[1]
    assert "rank 1 (pp=0/1, dp=1/2, cp=0/1) has stopped answering (process" in peer[1] and "seen by rank 0" in peer[1]


def test_a_raising_rank_posts_its_error_and_its_peer_names_it():
    (peer, raised), _ = run("raised")
    assert raised[1].startswith("RuntimeError: injected on rank 1")
    assert "rank 1 (pp=0/1, dp=1/2, cp=0/1) failed: RuntimeError: injected on rank 1" in peer[1], peer[1]


def test_the_store_host_failing_waits_until_its_peer_has_read_why():
    # rank 0's process hosts the job's store; its peer reads what was posted 3 s late (a busy rank). A fixed
    # pause before rank 0 ended (1 s) lost the reason: the peer's error then said only that the store was gone
    (raised, peer), _ = run("raised_on_the_store_host")
    assert raised[1].startswith("RuntimeError: injected on rank 0")
    assert peer[1].startswith("CollectiveFault: rank 1/2"), peer[1]
    assert "The peers: rank 0 (pp=0/1, dp=0/2, cp=0/1) failed: RuntimeError: injected on rank 0" in peer[1], peer[1]


def test_a_collective_issued_on_one_rank_only_ends_both_within_the_fault_timeout():
    (peer, extra), seconds = run("extra")
    # each rank either found the stall itself (every rank's position listed) or, blocked on the stalled
    # rank that exited first, names it with the report it posted
    for message in (peer[1], extra[1]):
        assert message.startswith("CollectiveFault: rank") and "have not progressed for 3 s" in message, message
        assert "rank 1 (pp=0/1, dp=1/2, cp=0/1)" in message and "'the optimizer's parameter all-gather, bucket 0'" \
            in message, message
    assert seconds < 60  # the launcher's collective timeout: without the watchdog, gloo's error came at 60 s
