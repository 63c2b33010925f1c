"""Faults end as errors that name the culprit: a journal of each rank's collectives, and a watchdog.

Every rank keeps a journal of what gradsched issues eagerly (parameter gathers, loss and norm all-reduces)
and of the phases it runs (a step's schedule, the flush graph, a checkpoint), with Flight Recorder's
fields: sequence number, what, group, op, element count, dtype, state and time. A daemon thread publishes this rank's status to a clone of
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
- A rank that has issued nothing for `timeout_s` and waits for an alive peer that issues nothing
  either (a loop, a sleep, a straggler: gradsched.sync.stuck, from every rank's groups' sequence
  numbers) names that peer with its position and Python stack and ends; so does the peer. A
  collective issued on some ranks only (every rank of the group issued as many, none progresses)
  is a stall: the watchdog names every peer's position and ends. Either way exit code 3 (rank 0
  last), since a collective blocked inside gloo cannot be interrupted from Python; the ranks
  blocked on it then fail and name it.

Compiling (Dynamo's callbacks, entries of kind "compile") and checkpoints ("io") are given `compile_timeout_s`.
Store operations time out after STORE_TIMEOUT_S: the watchdog cannot hang a healthy run.
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

from gradsched.sync import peers, stuck
from gradsched.user_errors import own_error
from gradsched.sync.peers import INTERVAL_S, is_comm_error, known_cause as _known_cause  # noqa: F401 - is_comm_error: its old home

GRACE_S = 5.0  # after a peer is found gone, how long a rank still blocked in an entry waits for its own error
STORE_TIMEOUT_S = 5.0
STALL_EXIT_CODE = 3
KEPT = 8  # entries printed per rank
HOLD_S = 10.0  # at most this long the store's host, ending after a fault, waits for its peers to fetch it


class CollectiveFault(RuntimeError):
    """Another rank failed, stopped, or issued other collectives: names which, and where this rank was."""


@dataclass
class Entry:
    seq: int
    what: str  # e.g. "the optimizer's parameter all-gather, bucket 1"
    kind: str  # "collective" (eager), "phase", or "compile" / "io" (given compile_timeout_s: gradsched.sync.stuck)
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
        self.pgs: dict[str, tuple] = {}  # group name -> (global ranks, ProcessGroup): every group this rank is in
        self.timeout_s = 30.0
        self.compile_timeout_s = 600.0  # for entries of kind "compile" and "io" (gradsched.sync.stuck)
        self.compiling = 0  # Dynamo compiles under way (its callbacks: its trace too, before any backend)
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
        self.last: Entry | None = None  # the entry closed last
        self.publish_asked = False  # a step ended since the last beat's publish: `_stop` publishes it at exit
        self.ending = False  # the watchdog is writing its report and will end the process
        self.counts, self.counts_moved = None, time.monotonic()  # this rank's groups' sequence numbers, and
        # when they last moved (this rank's clock): a rank that issues nothing for the fault timeout is judged

    # ---- recording ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def entry(self, what: str, kind: str = "phase", group=None, op: str = "", numel: int = 0, dtype=""):
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        if group is not None:
            self.groups[ranks] = group
            register_group(group)
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
            if self.ending:  # the watchdog is ending this process with its own report: no second one
                time.sleep(4 * STORE_TIMEOUT_S)
            if isinstance(exc, CollectiveFault) or isinstance(exc.__cause__, CollectiveFault) or \
                    type(exc).__name__ == "CollectiveMismatch":
                raise  # named already
            if is_comm_error(exc):
                cause = _known_cause()  # e.g. the ranks ran different collectives (agreement)
                fault = cause[0](cause[1]) if cause else CollectiveFault(self.diagnose(e, exc))
                hold_the_store(self)  # rank 0: its process ends with this error, and the store with it
                raise fault from exc
            if len(self.open) == 1:  # this rank's own error, leaving gradsched: the peers will ask why
                post_failure(exc)
            raise
        finally:
            e.ended = time.monotonic()
            self.open.remove(e)
            self.last = e
            if not self.open and kind != "collective":
                _publish_now(self)  # a rank that exits right after says where it was

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

    def status(self) -> dict:
        """What peers read of this rank. Ages are durations on this rank's clock, measured as it publishes."""
        opened, last, now = list(self.open), self.last, time.monotonic()
        e = opened[-1] if opened else None
        return {"beat": self.beat, "pid": os.getpid(), "host": socket.gethostname(), "host_id": peers.HOST_ID,
                "where": self.where, "open": asdict(e) if e is not None else None, "failed": self.stalled,
                "open_age_s": now - e.started if e is not None else None,
                "patient": self.compiling > 0 or any(o.kind in stuck.PATIENT_KINDS for o in opened),
                "last": {"what": last.what, "state": last.state} if last is not None else None,
                "last_age_s": now - (last.ended or now) if last is not None else None,
                "counts": self.counts or [], "idle_s": now - self.counts_moved, "fetched": self.fetched,
                "seqs": {str(list(k)): stuck.sequence_number(pg) for k, pg in list(self.groups.items())}}


JOURNAL = _Journal()


def configure(where: str, timeout_s: float, compile_timeout_s: float | None = None) -> None:
    """Name this rank in reports ('rank 1/4 (pp=0/2, dp=1/2, cp=0/1)') and set the stall timeouts."""
    JOURNAL.where, JOURNAL.timeout_s = where, timeout_s
    if compile_timeout_s is not None:
        JOURNAL.compile_timeout_s = compile_timeout_s
    stuck.watch_compiles(JOURNAL)


def register_group(pg) -> None:
    """A process group this rank is in: its sequence number (what the rank has issued there) is published
    with every beat, so that a rank everybody waits for can be found (gradsched.sync.stuck)."""
    try:
        JOURNAL.pgs[pg.group_name] = (tuple(dist.get_process_group_ranks(pg)), pg)
    except Exception:  # noqa: BLE001 - a group without a name or ranks (fake, torn down): not watched
        pass


def post_failure(exc: BaseException) -> None:
    """Tell the peers why this rank is about to stop (before its error propagates); rank 0 gives their
    watchdogs a beat to fetch it: the store lives in its process, gone once it ends."""
    exc = own_error(exc) or exc  # gradsched's own error, not the wrapper Dynamo or pipelining put around it
    text = str(exc).strip()
    _post(JOURNAL, f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__)
    hold_the_store(JOURNAL)


def _post(j: _Journal, why: str) -> None:
    """This rank's error (or stall report), in its status and in the job's list of failures."""
    j.stalled = why
    _publish(j)
    if j.store is not None and dist.is_initialized():
        peers.append(j, [dist.get_rank(), f"failed: {why}", j.where, "error", j.beat])


def hold_the_store(j: _Journal) -> None:
    """Rank 0, ending after a fault, holds the store it hosts until its peers have read why (peers.hold_for)."""
    if dist.is_initialized() and dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        peers.hold_for(j, HOLD_S)


def _publish_now(j: _Journal) -> None:
    """A step's outermost phase closed: its status is published with the next beat, or at exit by `_stop` (a
    rank that exits right after still says where it was). Not at once: a write a step per rank is a write every
    ~25 ms per rank to the one store rank 0 hosts (40 000 a second at 1 000 ranks); the beat is one a 0.5 s."""
    if j.thread is not None:
        j.publish_asked = True


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
    if getattr(j, "stopped_for", None) is world:  # stopped for good under this group (stop(), leave())
        return
    j._reset(world)  # the first entry under this default process group: the old thread sees it and ends
    try:
        store = dist.distributed_c10d._get_default_store().clone()  # its own connection: thread-safe use
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a store without clone: no watchdog, errors stay gloo's
        return
    j.store = peers.HostWatchedStore(store, {})
    if dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        with contextlib.suppress(Exception):  # env:// without torchrun's agent: rank 0's process hosts the store
            store.set(peers.STORE_HOST, json.dumps({"pid": os.getpid(), "host_id": peers.HOST_ID}))
    j.wake = threading.Event()  # set by _stop: the thread leaves its sleep at once
    j.thread = threading.Thread(target=_watch, args=(j, world), name="gradsched-watchdog", daemon=True)
    j.thread.start()
    if not j.stopper:
        j.stopper = True
        atexit.register(_stop, j)


def _stop(j: _Journal) -> None:
    """End the thread, for good under this process group, and drop its store connections: at exit, before the
    interpreter tears the store down under a thread inside a store call ('terminate called without an active
    exception', seen once); and before a rank leaves (stop(), gradsched.launch.leave)."""
    thread, world, j.world = j.thread, j.world, None
    if world is not None:
        j.stopped_for = world
    wake = getattr(j, "wake", None)
    if wake is not None:
        wake.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=STORE_TIMEOUT_S + 1.0)
    if j.publish_asked and j.store is not None:  # the last step's end, not yet published by the thread
        j.publish_asked = False
        _publish(j)
    j.store = None


def _watch(j: _Journal, world) -> None:
    wake = getattr(j, "wake", None) or threading.Event()
    while dist.is_initialized() and j.world is world:
        try:
            if isinstance(j.store, peers.HostWatchedStore):
                j.store.learn_host()
            _check(j)
        except Exception:  # noqa: BLE001 - the watchdog never takes a healthy run down (a group torn down, ...)
            pass
        # until the next beat; _stop unsets the world and wakes the thread, which then ends (no further store call)
        wake.wait(INTERVAL_S)


def _check(j: _Journal) -> None:
    stuck.track_counts(j)
    j.publish_asked = False  # asked before this beat's status is read: it is in it
    _publish(j)
    stuck.answer_stack_request(j, dist.get_rank(), _end)
    _watch_neighbour(j)
    fetched = j.fetched
    peers.fetch_failures(j)
    if j.fetched != fetched:  # said at once: the store's host may be waiting for it to end (hold_the_store)
        _publish(j)
    opened = list(j.open)  # the main thread opens and closes entries meanwhile
    if opened and _blocked_on_the_gone(j, opened[0]):
        return
    if time.monotonic() - j.counts_moved > j.timeout_s and stuck.name_the_stuck(j, dist.get_rank(), _end):
        return
    waiting = opened[-1] if opened else None
    if waiting is None or waiting.kind != "collective" or not waiting.group or \
            time.monotonic() - waiting.started <= j.timeout_s:
        return
    report = stuck.stall(j, waiting, dist.get_rank())
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


def _end(j: _Journal, report: str, post_all: bool | None = True) -> None:
    """Post the report (up to its trace; its first line only with post_all=False; nothing with None), print it
    with its first line last (a log's last line says why), hand it to the hooks, and end the process (rank 0,
    the store's host, last)."""
    cause = _known_cause(j.store)  # e.g. the digests this rank gathered already say why
    report = f"{cause[0].__name__}: {cause[1]}\n{report}" if cause else report
    summary, _, details = report.partition("\n")
    if post_all is not None:
        _post(j, report.split("This rank's last entries:")[0].strip() if post_all else summary.strip())
    if details:
        print(details, file=sys.stderr, flush=True)
    print(f"gradsched: {summary}", file=sys.stderr, flush=True)
    for callback in j.on_fault:
        with contextlib.suppress(Exception):
            callback(report)
    hold_the_store(j)  # rank 0 hosts the store: the peers read this report there first
    os._exit(STALL_EXIT_CODE)


def peers_report(ranks=None, since: float | None = None) -> str:
    """The peers that failed, are gone or never reported (gradsched.sync.peers.report), for errors raised elsewhere."""
    return peers.report(JOURNAL, ranks, since)


def stop() -> None:
    """Stop this rank's watchdog now (its thread joined, its store connections closed) and for the rest of the
    current process group: a rank about to print its last line, or to leave (gradsched.launch.leave), makes no
    store call after it."""
    _stop(JOURNAL)
