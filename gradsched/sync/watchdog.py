"""Faults end as errors that name the culprit: a journal of each rank's collectives, and a watchdog.

Every rank keeps a journal of what gradsched issues eagerly (the optimizer's parameter gathers,
the loss and norm all-reduces) and of the compiled graphs and phases it runs (a step's schedule,
the flush graph, a checkpoint), with Flight Recorder's fields: sequence number, what, group, op,
element count, dtype, state and time. A daemon thread publishes this rank's status to a clone of
the job's store every `INTERVAL_S` (its open entry, its groups' c10d sequence numbers, its pid and
host) and fetches the errors peers posted (the store lives in rank 0's process: once rank 0 ends,
what was not fetched is lost), and watches:

- A rank whose own error leaves gradsched posts it (`post_failure`; rank 0 then waits a beat before it
  goes on failing). An operation that fails on a peer (gloo raises "Connection closed by peer"
  when a rank is gone) leaves as a CollectiveFault naming the ranks that posted an error since
  the operation began, whose process is gone (its pid, on this host) or whose heartbeat
  stopped, with what this rank was waiting for and its last entries.
- Each rank watches the next one's heartbeat (one read a beat, whatever the world's size) and posts
  it once it is gone or has stopped answering (a killed or SIGSTOPped rank cannot say so itself).
  A rank still inside an entry it began before that, GRACE_S later, ends with a report naming it:
  gloo would wait for a silent peer up to its timeout (30 minutes by default).
- A collective this rank has waited in for `timeout_s` while every peer of its group is alive and
  waiting in a collective too (none progresses: a collective issued on some ranks only) is a
  stall: the watchdog names every peer's position and its group's collective count (a rank whose
  count differs issued a collective the others did not), posts it, prints it and ends the process
  (exit code 3; rank 0 last), since a collective blocked inside gloo cannot be interrupted from
  Python. The ranks blocked on it then fail and name it.

A phase (compute, compiled graphs) is never timed out: only eager collectives whose peers all
wait are. The watchdog's own store operations are no collectives, so it cannot hang a healthy run.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch.distributed as dist

INTERVAL_S = 0.5  # heartbeat period
DEAD_AFTER_S = 10.0  # a heartbeat older than this (20 beats): the rank stopped answering
GRACE_S = 5.0  # after a peer is found gone, how long a rank still blocked in an entry waits for its own error
STALL_EXIT_CODE = 3
KEPT = 8  # entries printed per rank


class CollectiveFault(RuntimeError):
    """Another rank failed, stopped, or issued other collectives: names which, and where this rank was."""


@dataclass
class Entry:
    seq: int
    what: str  # e.g. "optimizer all-gather, bucket 1 (9344 elements)"
    kind: str  # "collective" (eager, timed out when every peer waits too) or "phase"
    group: tuple[int, ...] = ()  # global ranks
    op: str = ""
    numel: int = 0
    dtype: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None
    state: str = "started"  # started | completed | failed

    def line(self) -> str:
        took = f"{(self.ended or time.time()) - self.started:.2f} s"
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
        self.where = ""  # "rank 1 (stage 0, dp 1, cp 0)"
        self.on_fault = []  # callbacks(message) before a stalled process exits
        self.thread = None
        self.store = None
        self.stalled = None  # this rank's posted error (or stall report), and when
        self.failed_at = 0.0
        # rank -> (when, what happened, where, "error" | "gone"), fetched every beat: the store may go first
        self.failures: dict[int, tuple] = {}
        self.fetched = 0
        self.gone: set[int] = set()  # the neighbour this rank found gone

    # ---- recording ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def entry(self, what: str, kind: str = "phase", group=None, op: str = "", numel: int = 0, dtype=""):
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        if group is not None:
            self.groups[ranks] = group
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
            e.ended = time.time()
            self.open.remove(e)

    def trace(self) -> str:
        return "\n".join("    " + e.line() for e in self.entries[-KEPT:])

    # ---- what the others are doing --------------------------------------------------------------
    def statuses(self, ranks) -> dict[int, dict | None]:
        out = {}
        for r in ranks:
            try:
                out[r] = json.loads(self.store.get(f"gradsched/status/{r}")) if self.store.check(
                    [f"gradsched/status/{r}"]) else None
            except Exception:  # noqa: BLE001 - the store's host (rank 0's process) may be the rank that died
                out[r] = {"store_gone": True}
        return out

    def diagnose(self, waiting: Entry, exc: BaseException | None = None) -> str:
        me = dist.get_rank() if dist.is_initialized() else 0
        why = peers_report(waiting.group or None, waiting.started) or "none posted an error, every heartbeat is fresh"
        cause = f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]})" if exc is not None else ""
        return (f"{self.where or f'rank {me}'} was waiting in {waiting.op or waiting.kind} "
                f"'{waiting.what}'{f' over ranks {list(waiting.group)}' if waiting.group else ''} when it "
                f"failed{cause}. The peers: {why}. This rank's last entries:\n{self.trace()}")

    def stall(self, waiting: Entry) -> str | None:
        """The stall report, when this rank and every peer of its group wait in collectives, all alive."""
        me = dist.get_rank()
        st = self.statuses([r for r in waiting.group if r != me])
        # a peer that found the stall first has posted it and is still waiting: it counts as waiting
        if any(s is None or s.get("store_gone") or not _alive(s) or (s.get("open") or {}).get("kind") != "collective"
               for s in st.values()):
            return None
        seqs = {me: _seq(self.groups.get(waiting.group))}
        seqs.update({r: s["seqs"].get(str(list(waiting.group))) for r, s in st.items()})
        lines = [f"rank {me}{_where(self.status())}: #{waiting.seq} '{waiting.what}', collective {seqs[me]} of the group"]
        lines += [f"rank {r}{_where(s)}: #{s['open']['seq']} '{s['open']['what']}', collective {seqs[r]} of the group"
                  for r, s in st.items()]
        counts = sorted(set(seqs.values()), key=lambda n: -list(seqs.values()).count(n))
        if len(counts) > 1:
            odd = [r for r, n in seqs.items() if n != counts[0]]
            verdict = (f"rank(s) {odd} issued another number of collectives on this group than the rest: a collective "
                       "issued (or dropped) there alone")
        else:
            verdict = (f"each rank is in its collective number {counts[0]} on this group, and they are not the same "
                       "operation on every rank: some rank issued a collective outside gradsched's plan instead")
        return (f"{self.where or f'rank {me}'}: the collectives of ranks {list(waiting.group)} have not progressed "
                f"for {time.time() - waiting.started:.0f} s (fault_timeout_s={self.timeout_s:g}), every rank alive and "
                f"waiting; {verdict}.\n  " + "\n  ".join(lines) + f"\nThis rank's last entries:\n{self.trace()}")

    def status(self) -> dict:
        e = self.open[-1] if self.open else None
        return {"t": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "where": self.where,
                "open": asdict(e) if e is not None else None, "failed": self.stalled, "failed_at": self.failed_at,
                "seqs": {str(list(k)): _seq(pg) for k, pg in list(self.groups.items())}}


def _seq(pg) -> int | None:
    try:
        return pg._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001
        return None


def _where(st: dict | None) -> str:
    w = (st or {}).get("where") or ""
    return f" ({w.split('(', 1)[1]}" if "(" in w else ""


def _pid_exists(pid: int) -> bool:
    """A running (or stopped) process, not a dead one waiting to be reaped (a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    with contextlib.suppress(OSError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _alive(st: dict) -> bool:
    if st.get("host") == socket.gethostname() and not _pid_exists(st["pid"]):
        return False
    return time.time() - st["t"] < DEAD_AFTER_S


def _faulty(st: dict | None, since: float = 0.0) -> bool:
    return st is None or st.get("store_gone") or not _alive(st) or \
        bool(st.get("failed")) and st.get("failed_at", 0.0) >= since - 1.0


def _state(st: dict | None) -> str:
    if st is None:
        return "never reported (it may have died before its first heartbeat)"
    if st.get("store_gone"):
        return "cannot be asked: the job's store, hosted by rank 0's process, does not answer (rank 0 is gone)"
    if st.get("failed"):
        return f"failed: {st['failed']}"
    opened = st.get("open")
    inside = f" while in '{opened['what']}'" if opened else ""
    if not _alive(st):
        age = f"last heartbeat {time.time() - st['t']:.1f} s ago{inside}"
        if st.get("host") == socket.gethostname() and _pid_exists(st["pid"]):
            return f"has stopped answering (process {st['pid']} on {st['host']} exists, {age})"
        return f"is gone (process {st['pid']} on {st['host']}, {age})"
    return f"alive{inside}"


JOURNAL = _Journal()


def configure(where: str, timeout_s: float) -> None:
    """Name this rank in reports ('rank 1 (stage 0, dp 1, cp 0)') and set the stall timeout."""
    JOURNAL.where, JOURNAL.timeout_s = where, timeout_s


def post_failure(exc: BaseException) -> None:
    """Tell the peers why this rank is about to stop (before its error propagates); rank 0 gives their
    watchdogs a beat to fetch it: the store lives in its process, gone once it ends."""
    text = str(exc).strip()
    _post(JOURNAL, f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__)
    if JOURNAL.store is not None and dist.get_rank() == 0:
        time.sleep(2 * INTERVAL_S)


def _post(j: _Journal, why: str) -> None:
    """This rank's error (or stall report), in its status and in the job's list of failures."""
    j.stalled, j.failed_at = why, time.time()
    _publish(j)
    if j.store is not None:
        with contextlib.suppress(Exception):
            k = j.store.add("gradsched/failures", 1)
            j.store.set(f"gradsched/failed/{k}", json.dumps([dist.get_rank(), j.failed_at, f"failed: {why}",
                                                             j.where, "error"]))


def _fetch_failures(j: _Journal) -> None:
    """The errors peers posted since the last beat (one store read when there are none)."""
    posted = j.store.add("gradsched/failures", 0)
    for k in range(j.fetched + 1, posted + 1):
        rank, when, text, where, kind = json.loads(j.store.get(f"gradsched/failed/{k}"))
        if kind == "gone" and j.failures.get(rank, (0, "", "", ""))[3] == "error":
            continue  # its own error says why it went
        j.failures[rank] = (when, text, where, kind)
        j.fetched = k


def _watch_neighbour(j: _Journal) -> None:
    """Each rank watches the next one (one read a beat, whatever the world's size) and posts it once
    it is gone or has stopped answering: a rank killed or stopped cannot say so itself."""
    me, world = dist.get_rank(), dist.get_world_size()
    r = (me + 1) % world
    if r == me or r in j.gone:
        return
    st = j.statuses([r])[r]
    if st is None or st.get("store_gone") or _alive(st):
        return
    j.gone.add(r)
    text = _state(dict(st, failed=None))
    with contextlib.suppress(Exception):
        k = j.store.add("gradsched/failures", 1)
        j.store.set(f"gradsched/failed/{k}", json.dumps([r, time.time(), f"{text}, seen by rank {me}",
                                                         st.get("where", ""), "gone"]))


def is_comm_error(exc: BaseException) -> bool:
    """An error of the transport (a peer is gone, a collective timed out), not of this rank's own code."""
    text = str(exc)
    return isinstance(exc, dist.DistBackendError) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Connection refused", "gloo/transport",
        "Timed out waiting", "timed out", "NCCL"))


def peers_report(ranks=None, since: float = 0.0) -> str:
    """One line on the peers that failed (an error posted after `since`), are gone, or never reported."""
    j = JOURNAL
    if j.store is None or not dist.is_initialized():
        return ""
    me = dist.get_rank()
    ranks = [r for r in (ranks if ranks is not None else range(dist.get_world_size())) if r != me]
    time.sleep(2 * INTERVAL_S)
    with contextlib.suppress(Exception):
        _fetch_failures(j)
    statuses = j.statuses(ranks)
    posted = {r: f[1:] for r, f in j.failures.items() if f[0] >= since - 1.0}  # not an earlier, caught one
    bad = [f"rank {r}{_where({'where': posted[r][1]})} {posted[r][0]}" if r in posted else
           f"rank {r}{_where(statuses[r])} {_state(statuses[r])}" for r in ranks
           if r in posted or _faulty(statuses[r], since)]
    return "; ".join(bad)


def _publish(j: _Journal) -> None:
    if j.store is not None:
        with contextlib.suppress(Exception):
            j.store.set(f"gradsched/status/{dist.get_rank()}", json.dumps(j.status()))


def _start(j: _Journal) -> None:
    if j.thread is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        j.store = dist.distributed_c10d._get_default_store().clone()  # its own connection: thread-safe use
    except Exception:  # noqa: BLE001 - a store without clone: no watchdog, errors stay gloo's
        return
    j.thread = threading.Thread(target=_watch, args=(j,), name="gradsched-watchdog", daemon=True)
    j.thread.start()


def _watch(j: _Journal) -> None:
    while dist.is_initialized():
        try:
            _check(j)
        except Exception:  # noqa: BLE001 - the watchdog never takes a healthy run down (a group torn down, ...)
            pass
        time.sleep(INTERVAL_S)


def _check(j: _Journal) -> None:
    _publish(j)
    _watch_neighbour(j)
    _fetch_failures(j)
    opened = list(j.open)  # the main thread opens and closes entries meanwhile
    waiting = opened[-1] if opened else None
    if waiting is not None and _blocked_on_the_gone(j, opened[0]):
        return
    if waiting is None or waiting.kind != "collective" or not waiting.group or waiting.state != "started" or \
            time.time() - waiting.started <= j.timeout_s:
        return
    report = j.stall(waiting)
    if report is not None:
        _end(j, report)


def _blocked_on_the_gone(j: _Journal, outer: Entry) -> bool:
    """A peer found gone (killed, or stopped answering) while this rank is still inside an entry it began
    before, GRACE_S later: gloo would wait for it up to its timeout (30 minutes by default). End here."""
    gone = {r: f for r, f in j.failures.items() if f[3] == "gone"}
    late = {r: f for r, f in gone.items() if f[0] > outer.started and time.time() - f[0] > GRACE_S}
    if not late or outer.state != "started":
        return False
    names = "; ".join(f"rank {r}{_where({'where': f[2]})} {f[1]}" for r, f in sorted(late.items()))
    inner = j.open[-1] if j.open else outer
    _end(j, f"{j.where or f'rank {dist.get_rank()}'} has waited in {inner.op or inner.kind} '{inner.what}' for "
            f"{time.time() - inner.started:.0f} s, and a peer is gone: {names}.\nThis rank's last entries:\n{j.trace()}")
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
