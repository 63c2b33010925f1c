"""What a rank knows of its peers, through the job's store: their status, their beat, what they posted.

Liveness is judged from beat counters seen changing on this rank's own monotonic clock (`seen`),
never by comparing two hosts' clocks; a process on this host (same boot and pid namespace) is
gone when its pid is. The functions take the journal (gradsched.sync.watchdog) whose store,
lock, `seen` and `failures` they read and update. Also: whether an error is the transport's (a peer
gone) rather than this rank's own (`is_comm_error`), and causes of a failed collective this rank
already knows without asking anyone (`known_cause`).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import torch.distributed as dist

INTERVAL_S = 0.5  # heartbeat period
DEAD_AFTER_S = 10.0  # a beat that has not moved for this long (20 beats): the rank stopped answering
HOST_CHECK_S = 1.0  # the store's host process is looked at no more often than this


def host_identity() -> str:
    """This host's and pid namespace's identity: two containers may share a hostname, not both of these."""
    ids = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            ids.append(f.read().strip())
    with contextlib.suppress(OSError):
        ids.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return "/".join(ids)


HOST_ID = host_identity()


def statuses(j, ranks) -> dict[int, dict | None]:
    """Each rank's last published status (None: never published); {"store_gone": True} when the store
    does not answer. Every read updates `seen`."""
    out = {}
    for r in ranks:
        try:
            key = f"gradsched/status/{r}"
            out[r] = json.loads(j.store.get(key)) if j.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store's host (rank 0's process) may be the rank that died
            out[r] = {"store_gone": True}
            continue
        if out[r] is not None:
            with j.lock:
                beat, when = j.seen.get(r, (None, 0.0))
                if out[r]["beat"] != beat:
                    j.seen[r] = (out[r]["beat"], time.monotonic())
    return out

def silent_for(j, r: int) -> float:
    """Seconds since this rank last saw rank r's beat move (0 if never seen)."""
    with j.lock:
        beat, when = j.seen.get(r, (None, None))
    return 0.0 if when is None else time.monotonic() - when



def where_suffix(where: str | None) -> str:
    """' (pp=0/2, dp=1/2, cp=0/1)' from 'rank 1/4 (pp=0/2, dp=1/2, cp=0/1)'."""
    return f" ({where.split('(', 1)[1]}" if where and "(" in where else ""


def pid_exists(pid: int) -> bool:
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


def process_gone(st: dict) -> bool:
    return st.get("host_id") == HOST_ID and not pid_exists(st["pid"])


def gone(j, r: int, st: dict) -> bool:
    """Rank r's process is gone (on this host), or its beat has not moved for DEAD_AFTER_S here."""
    return process_gone(st) or silent_for(j, r) >= DEAD_AFTER_S


def state(j, r: int, st: dict | None) -> str:
    if st is None:
        return "never reported (it may have died before its first heartbeat)"
    if st.get("store_gone"):
        return "cannot be asked: the job's store, hosted by rank 0's process, does not answer (rank 0 is gone)"
    if st.get("failed"):
        return f"failed: {st['failed']}"
    opened, last = st.get("open"), st.get("last")
    # a status is as old as its last publication: a beat (INTERVAL_S) at most, and a step's end
    inside = (f"; at its last heartbeat it was in '{opened['what']}'" if opened else
              f"; its last entry, '{last['what']}', had {last['state']}" if last else "")
    if process_gone(st):
        return f"is gone (process {st['pid']} on {st['host']} exited{inside})"
    silent = silent_for(j, r)
    if silent >= DEAD_AFTER_S:
        return f"has stopped answering (process {st['pid']} on {st['host']}, no heartbeat for {silent:.0f} s{inside})"
    return f"alive{inside}"


def faulty(j, r: int, st: dict | None) -> bool:
    return st is None or st.get("store_gone") or bool(st.get("failed")) or gone(j, r, st)


def append(j, record: list) -> None:
    with contextlib.suppress(Exception):
        k = j.store.add("gradsched/failures", 1)
        j.store.set(f"gradsched/failed/{k}", json.dumps(record))


def fetch_failures(j) -> None:
    """The errors and departures peers posted since the last beat (one store read when there are none)."""
    posted = j.store.add("gradsched/failures", 0)
    for k in range(j.fetched + 1, posted + 1):
        key = f"gradsched/failed/{k}"
        if not j.store.check([key]):
            return  # counted, not written yet (or its writer died in between): next beat
        rank, text, where, kind, beat = json.loads(j.store.get(key))
        with j.lock:
            known = j.failures.get(rank)
            if not (kind == "gone" and known and known[3] == "error" and time.monotonic() - known[0] < 60.0):
                j.failures[rank] = (time.monotonic(), text, where, kind, beat)  # its own error says why it went
        j.fetched = k


def hold_for(j, timeout_s: float) -> None:
    """On the process hosting the job's store, about to end after a fault: wait until every peer has fetched every
    failure posted so far (its status's `fetched`), or is gone, at most `timeout_s`. A peer that fails later, once
    the store is gone, still names who failed first from what it fetched (a fixed pause let a busy peer miss it).
    With nothing posted, returns at once."""
    if j.store is None or not dist.is_initialized():
        return
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(Exception):
        posted = j.store.add("gradsched/failures", 0)
        others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
        while posted and others and time.monotonic() < deadline:
            now = statuses(j, others)
            others = [r for r in others if now[r] is not None and not now[r].get("store_gone") and
                      not process_gone(now[r]) and now[r].get("fetched", 0) < posted]
            if others:
                time.sleep(INTERVAL_S / 5)


def report(j, ranks=None, since: float | None = None) -> str:
    """One line on the peers that posted an error (around `since`, this rank's monotonic time, or later),
    are gone, or never reported. Waits two beats, so what a failing peer posts arrives first."""
    if j.store is None or not dist.is_initialized():
        return ""
    me = dist.get_rank()
    ranks = [r for r in (ranks if ranks is not None else range(dist.get_world_size())) if r != me]
    statuses(j, ranks)
    time.sleep(2 * INTERVAL_S)
    with contextlib.suppress(Exception):
        fetch_failures(j)
    now = statuses(j, ranks)
    with j.lock:
        failures = dict(j.failures)
    posted = {r: f for r, f in failures.items() if since is None or f[0] >= since - 2.0}  # not an earlier, caught one
    named = [r for r in ranks if r in posted or faulty(j, r, now[r])]
    # what peers posted first, the store's host gone last: a message's first words say who failed
    named.sort(key=lambda r: 0 if r in posted else 2 if (now[r] or {}).get("store_gone") else 1)
    return "; ".join(f"rank {r}{where_suffix(posted[r][2])} {posted[r][1]}" if r in posted else
                     f"rank {r}{where_suffix((now[r] or {}).get('where'))} {state(j, r, now[r])}" for r in named)


STORE_HOST = "gradsched/store_host"  # {"pid", "host_id"} of the process hosting the store, when it is rank 0's


class HostWatchedStore:
    """A store connection of the watchdog's that refuses every call, without making it, once the process hosting
    the store (rank 0's, which says so under STORE_HOST) is known gone on this host: a call to a store whose host
    has exited fails anyway, after TCPStore has logged its C++ error and stack ('recvValue failed ... Connection
    reset by peer', 'frame #0: ...'), at every beat and in every report, until this rank ends. The connections of
    one process group share `known`."""

    def __init__(self, store, known: dict):
        self._store, self.known = store, known

    def learn_host(self) -> None:
        if "host" not in self.known and self._store.check([STORE_HOST]):
            self.known["host"] = json.loads(self._store.get(STORE_HOST))

    def host_gone(self) -> bool:
        # looked at no more than every HOST_CHECK_S: a look is a signal and a /proc read, and the main thread
        # goes through here for every store call it makes
        now = time.monotonic()
        if "host" in self.known and now - self.known.get("host_seen", -HOST_CHECK_S) >= HOST_CHECK_S:
            if process_gone(self.known["host"]):
                return True
            self.known["host_seen"] = now
        return False

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self.host_gone():
                raise dist.DistNetworkError("the job's store does not answer: the process hosting it (rank 0's) "
                                            "has exited")
            return attr(*args, **kwargs)
        return call


# functions(store or None) -> (exception class, message) or None: a cause of failed or stalled collectives that
# this rank already knows without waiting (gradsched.sync.agreement_check registers the ranks' differing graphs)
KNOWN_CAUSES: list = []


def known_cause(store=None):
    return next((c for c in (f(store) for f in KNOWN_CAUSES) if c), None)


def is_comm_error(exc: BaseException) -> bool:
    """An error of the transport (a peer is gone, a collective timed out), not of this rank's own code: the
    error itself or any in its chain (pipelining and Dynamo wrap the transport's error in their own)."""
    types = tuple(t for t in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None)) if t)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, types) or any(s in text for s in (
                "Connection closed by peer", "Connection reset by peer", "gloo/transport", "Broken pipe")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
