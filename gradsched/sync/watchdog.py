"""Faults end as errors that name the culprit: a journal of each rank's collectives, and a watchdog.

Every rank keeps a journal of what gradsched issues eagerly (the optimizer's parameter gathers,
the loss and norm all-reduces) and of the compiled graphs and phases it runs (a step's schedule,
the flush graph, a checkpoint), with Flight Recorder's fields: sequence number, what, group, op,
element count, dtype, state and time. A daemon thread publishes this rank's status to a clone of
the job's store every `INTERVAL_S` (a beat counter, its open entry, its groups' c10d sequence
numbers, its pid and host) and fetches the errors peers posted (the store lives in rank 0's
process: once rank 0 ends, what was not fetched is lost). Liveness is judged from beat counters
seen changing on this rank's own monotonic clock, never by comparing two hosts' clocks.

- A rank whose own error leaves gradsched posts it (`post_failure`; rank 0 then waits a beat
  before it goes on failing); its next step clears it. An operation that fails on a peer (gloo's
  "Connection closed by peer" when a rank is gone) leaves as a CollectiveFault naming the ranks
  that posted an error around the time the operation began, whose process is gone (its pid, on
  this host) or whose heartbeat stopped, with what this rank was waiting for and its last entries.
- Each rank watches the next one's beat (one read a beat, whatever the world's size) and posts it
  once its process is gone or its beat has not moved for peers.DEAD_AFTER_S (a killed or SIGSTOPped rank
  cannot say so itself). A rank still inside an entry it began before that, GRACE_S later, and the
  peer still silent, ends with a report naming it: gloo would wait up to its timeout (30 minutes).
- A collective this rank has waited in for `timeout_s` while every peer of its group is alive and
  waiting in a collective of the same group (none progresses: a collective issued on some ranks
  only) is a stall: the watchdog names every peer's position and its group's collective count (a
  rank whose count differs issued a collective the others did not), posts it, prints it and ends
  the process (exit code 3; rank 0 last), since a collective blocked inside gloo cannot be
  interrupted from Python. The ranks blocked on it then fail and name it.

A phase (compute, compiled graphs) is never timed out: only eager collectives whose peers all
wait are. The watchdog's store operations are no collectives and time out after STORE_TIMEOUT_S,
so it cannot hang a healthy run; a new default process group starts it anew.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch.distributed as dist

from gradsched.sync import peers
from gradsched.sync.peers import INTERVAL_S

GRACE_S = 5.0  # after a peer is found gone, how long a rank still blocked in an entry waits for its own error
STORE_TIMEOUT_S = 5.0
STALL_EXIT_CODE = 3
KEPT = 8  # entries printed per rank


class CollectiveFault(RuntimeError):
    """Another rank failed, stopped, or issued other collectives: names which, and where this rank was."""


@dataclass
class Entry:
    seq: int
    what: str  # e.g. "the optimizer's parameter all-gather, bucket 1"
    kind: str  # "collective" (eager, timed out when every peer waits too) or "phase"
    group: tuple[int, ...] = ()  # global ranks
    op: str = ""
    numel: int = 0
    dtype: str = ""
    started: float = field(default_factory=time.monotonic)  # this rank's clock only
    ended: float | None = None
    state: str = "started"  # started | completed | failed

    def line(self) -> str:
        took = f"{(self.ended or time.monotonic()) - self.started:.2f} s"
        group = f" group {list(self.group)}" if self.group else ""
        size = f" {self.numel} x {self.dtype}" if self.numel else ""
        return f"#{self.seq} {self.state:9} {took:>8}  {self.op or self.kind}{group}{size}: {self.what}"


class _Journal:
    def __init__(self):
        self.entries: list[Entry] = []  # the last 64
        self.count = 0
        self.open: list[Entry] = []
        self.groups: dict[tuple, object] = {}  # global ranks -> ProcessGroup (for its sequence number)
        self.timeout_s = 30.0
        self.where = ""  # "rank 1/4 (pp=0/2, dp=1/2, cp=0/1)"
        self.on_fault = []  # callbacks(message) before the watchdog ends this process
        self.lock = threading.Lock()  # over `failures` and `seen`, shared with the watchdog thread
        self.stopper = False  # the exit hook that ends the thread is registered
        self._reset(None)

    def _reset(self, world) -> None:
        """A new default process group: a new store, nothing known of the peers yet."""
        self.world, self.store, self.thread = world, None, None
        self.beat = 0
        self.stalled = None  # this rank's posted error (or stall report), cleared by its next step
        self.failures: dict[int, tuple] = {}  # rank -> (fetched at, what happened, where, "error" | "gone", beat)
        self.fetched = 0
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its last beat, when this rank saw it change)
        self.gone: set[int] = set()  # the neighbour this rank posted gone

    # ---- recording ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def entry(self, what: str, kind: str = "phase", group=None, op: str = "", numel: int = 0, dtype=""):
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        if group is not None:
            self.groups[ranks] = group
        if not self.open:
            self.stalled = None  # a new step: an error this rank posted before was caught and survived
        self.count += 1
        e = Entry(self.count, what, kind, ranks, op, numel, str(dtype).replace("torch.", ""))
        self.entries.append(e)
        del self.entries[:-64]
        self.open.append(e)
        _start(self)
        try:
            yield e
            e.state = "completed"
        except BaseException as exc:  # noqa: BLE001 - named and re-raised
            e.state = "failed"
            if isinstance(exc, CollectiveFault) or isinstance(exc.__cause__, CollectiveFault):
                raise  # named already
            if is_comm_error(exc):
                raise CollectiveFault(self.diagnose(e, exc)) from exc
            if len(self.open) == 1:  # this rank's own error, leaving gradsched: the peers will ask why
                post_failure(exc)
            raise
        finally:
            e.ended = time.monotonic()
            self.open.remove(e)

    def trace(self) -> str:
        return "\n".join("    " + e.line() for e in list(self.entries)[-KEPT:])

    # ---- what the others are doing --------------------------------------------------------------
    def diagnose(self, waiting: Entry, exc: BaseException | None = None) -> str:
        me = dist.get_rank() if dist.is_initialized() else 0
        try:
            why = peers.report(JOURNAL, waiting.group or None, waiting.started) or \
                "none posted an error and every heartbeat moves"
        except Exception as e:  # noqa: BLE001 - a diagnosis never replaces the error it explains
            why = f"(could not ask them: {type(e).__name__})"
        text = str(exc).strip() if exc is not None else ""
        cause = f" ({type(exc).__name__}: {text.splitlines()[0][:160] if text else ''})" if exc is not None else ""
        return (f"{self.where or f'rank {me}'} was waiting in {waiting.op or waiting.kind} "
                f"'{waiting.what}'{f' over ranks {list(waiting.group)}' if waiting.group else ''} when it "
                f"failed{cause}. The peers: {why}. This rank's last entries:\n{self.trace()}")

    def stall(self, waiting: Entry) -> str | None:
        """The stall report, when every peer of the group is alive and waits in a collective of the group too."""
        me = dist.get_rank()
        st = peers.statuses(self, [r for r in waiting.group if r != me])
        for r, s in st.items():  # a peer that found the stall first has posted it, still waiting: it counts
            opened = (s or {}).get("open") or {}
            if s is None or s.get("store_gone") or peers.gone(self, r, s) or opened.get("kind") != "collective" or \
                    tuple(opened.get("group") or ()) != waiting.group:
                return None
        seqs = {me: _seq(self.groups.get(waiting.group))}
        seqs.update({r: s["seqs"].get(str(list(waiting.group))) for r, s in st.items()})
        lines = [f"rank {me}{peers.where_suffix(self.where)}: #{waiting.seq} '{waiting.what}', collective {seqs[me]} of the group"]
        lines += [f"rank {r}{peers.where_suffix(s['where'])}: #{s['open']['seq']} '{s['open']['what']}', collective {seqs[r]} "
                  "of the group" for r, s in st.items()]
        counts = sorted(set(seqs.values()), key=lambda n: -list(seqs.values()).count(n))
        if len(counts) > 1:
            odd = [r for r, n in seqs.items() if n != counts[0]]
            verdict = (f"rank(s) {odd} issued another number of collectives on this group than the rest: a collective "
                       "issued (or dropped) there alone")
        else:
            verdict = (f"each rank is in its collective number {counts[0]} on this group, and they are not the same "
                       "operation on every rank: some rank issued a collective outside gradsched's plan instead")
        return (f"{self.where or f'rank {me}'}: the collectives of ranks {list(waiting.group)} have not progressed "
                f"for {time.monotonic() - waiting.started:.0f} s (fault_timeout_s={self.timeout_s:g}), every rank "
                f"alive and waiting; {verdict}.\n  " + "\n  ".join(lines) +
                f"\nThis rank's last entries:\n{self.trace()}")

    def status(self) -> dict:
        opened = list(self.open)
        e = opened[-1] if opened else None
        return {"beat": self.beat, "pid": os.getpid(), "host": socket.gethostname(), "host_id": peers.HOST_ID,
                "where": self.where, "open": asdict(e) if e is not None else None, "failed": self.stalled,
                "seqs": {str(list(k)): _seq(pg) for k, pg in list(self.groups.items())}}


def _seq(pg) -> int | None:
    try:
        return pg._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001
        return None


JOURNAL = _Journal()


def configure(where: str, timeout_s: float) -> None:
    """Name this rank in reports ('rank 1/4 (pp=0/2, dp=1/2, cp=0/1)') and set the stall timeout."""
    JOURNAL.where, JOURNAL.timeout_s = where, timeout_s


def post_failure(exc: BaseException) -> None:
    """Tell the peers why this rank is about to stop (before its error propagates); rank 0 gives their
    watchdogs a beat to fetch it: the store lives in its process, gone once it ends."""
    text = str(exc).strip()
    _post(JOURNAL, f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__)
    if JOURNAL.store is not None and dist.is_initialized() and dist.get_rank() == 0:
        time.sleep(2 * INTERVAL_S)


def _post(j: _Journal, why: str) -> None:
    """This rank's error (or stall report), in its status and in the job's list of failures."""
    j.stalled = why
    _publish(j)
    if j.store is not None and dist.is_initialized():
        peers.append(j, [dist.get_rank(), f"failed: {why}", j.where, "error", j.beat])


def is_comm_error(exc: BaseException) -> bool:
    """An error of the transport (a peer is gone, a collective timed out), not of this rank's own code."""
    types = tuple(t for t in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None)) if t)
    text = str(exc)
    return isinstance(exc, types) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "gloo/transport"))


def _publish(j: _Journal) -> None:
    if j.store is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            j.beat += 1
            j.store.set(f"gradsched/status/{dist.get_rank()}", json.dumps(j.status()))


def _start(j: _Journal) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world = dist.group.WORLD
    if j.world is world and j.thread is not None:
        return
    j._reset(world)  # the first entry under this default process group: the old thread sees it and ends
    try:
        store = dist.distributed_c10d._get_default_store().clone()  # its own connection: thread-safe use
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a store without clone: no watchdog, errors stay gloo's
        return
    j.store = store
    j.thread = threading.Thread(target=_watch, args=(j, world), name="gradsched-watchdog", daemon=True)
    j.thread.start()
    if not j.stopper:
        j.stopper = True
        atexit.register(_stop, j)


def _stop(j: _Journal) -> None:
    """At exit, end the thread before the interpreter does: a daemon thread still inside a store call while
    the process tears the store down aborts it ('terminate called without an active exception', seen once)."""
    thread, j.world = j.thread, None
    if thread is not None:
        thread.join(timeout=STORE_TIMEOUT_S + 1.0)
    j.store = None


def _watch(j: _Journal, world) -> None:
    while dist.is_initialized() and j.world is world:
        try:
            _check(j)
        except Exception:  # noqa: BLE001 - the watchdog never takes a healthy run down (a group torn down, ...)
            pass
        time.sleep(INTERVAL_S)


def _check(j: _Journal) -> None:
    _publish(j)
    _watch_neighbour(j)
    peers.fetch_failures(j)
    opened = list(j.open)  # the main thread opens and closes entries meanwhile
    if opened and _blocked_on_the_gone(j, opened[0]):
        return
    waiting = opened[-1] if opened else None
    if waiting is None or waiting.kind != "collective" or not waiting.group or \
            time.monotonic() - waiting.started <= j.timeout_s:
        return
    report = j.stall(waiting)
    if report is not None and waiting.state == "started" and waiting in j.open:  # not completed meanwhile
        _end(j, report)


def _watch_neighbour(j: _Journal) -> None:
    """Each rank watches the next one (one read a beat, whatever the world's size) and posts it once its
    process is gone or its beat has not moved for peers.DEAD_AFTER_S: a killed or stopped rank cannot say so."""
    me, world = dist.get_rank(), dist.get_world_size()
    r = (me + 1) % world
    if r == me or r in j.gone:
        return
    st = peers.statuses(j, [r])[r]
    if st is None or st.get("store_gone") or not peers.gone(j, r, st):
        return
    j.gone.add(r)
    peers.append(j, [r, f"{peers.state(j, r, dict(st, failed=None))}, seen by rank {me}", st.get("where", ""), "gone",
                st["beat"]])


def _blocked_on_the_gone(j: _Journal, outer: Entry) -> bool:
    """A peer posted gone after this rank began its outermost entry, GRACE_S ago, and it is still silent:
    end here (gloo would wait for it up to its timeout, 30 minutes by default)."""
    with j.lock:
        gone = {r: f for r, f in j.failures.items() if f[3] == "gone" and f[0] > outer.started - 2.0}
    late = {r: f for r, f in gone.items() if time.monotonic() - f[0] > GRACE_S}
    if not late or outer.state != "started" or outer not in j.open:
        return False
    now = peers.statuses(j, list(late))
    still = {r: f for r, f in late.items() if now[r] is None or now[r].get("store_gone") or now[r]["beat"] == f[4]}
    if not still:  # they answered again: not gone after all
        with j.lock:
            for r in late:
                j.failures.pop(r, None)
        return False
    names = "; ".join(f"rank {r}{peers.where_suffix(f[2])} {f[1]}" for r, f in sorted(still.items()))
    inner = j.open[-1] if j.open else outer
    _end(j, f"{j.where or f'rank {dist.get_rank()}'} has waited in {inner.op or inner.kind} '{inner.what}' for "
            f"{time.monotonic() - inner.started:.0f} s, and a peer is gone: {names}.\n"
            f"This rank's last entries:\n{j.trace()}")
    return True


def _end(j: _Journal, report: str) -> None:
    """Post the report, print it, hand it to the hooks, and end the process (rank 0, the store's host, last)."""
    _post(j, report.split("This rank's last entries:")[0].strip())
    print(f"gradsched: {report}", file=sys.stderr, flush=True)
    for callback in j.on_fault:
        with contextlib.suppress(Exception):
            callback(report)
    if dist.get_rank() == 0:  # it hosts the store: the peers read this report there first
        time.sleep(4 * INTERVAL_S)
    os._exit(STALL_EXIT_CODE)


def peers_report(ranks=None, since: float | None = None) -> str:
    """The peers that failed, are gone or never reported (gradsched.sync.peers.report), for errors raised elsewhere."""
    return peers.report(JOURNAL, ranks, since)
