"""Who the job waits for: a rank that is alive but issues nothing, found from every rank's collective counts.

Each rank publishes with its heartbeat (gradsched.sync.watchdog) the c10d sequence number of each of its
process groups (how many collectives and p2p operations it has *issued* there, eager or from a compiled
graph) and for how long none of them has moved. A rank that has issued more on a group than a peer waits
for that peer. Following "waits for" from this rank, through peers that themselves wait, ends at ranks
that wait for nobody: those are what the job waits for. One of them whose counts have not moved for the
fault timeout is stuck (a Python loop, a sleep, a deadlock of its own) or slow beyond the timeout: it is
named, with its last journal entry, how long it has been there, and its Python stack, which its own
watchdog thread writes to the store when asked (`answer_stack_request`).

Compiling and writing files are not faults: a rank inside a journal entry of kind "compile" or "io" is
given `compile_timeout_s` instead. Store reads happen only on this slow path (a rank that has waited the
whole fault timeout), bounded by the groups along the chain; durations come from each rank's own clock.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback

from gradsched.sync import peers

PATIENT_KINDS = ("compile", "io")  # entries timed out by compile_timeout_s, not fault_timeout_s
STACK_FRAMES = 12


def my_counts(j) -> list:
    """[[group name, its global ranks, this rank's sequence number there], ...] for the groups it knows."""
    out = []
    for name, (ranks, pg) in list(j.pgs.items()):
        n = sequence_number(pg)
        if n is not None:  # a backend without sequence numbers: not judged
            out.append([name, list(ranks), n])
    return out


def _counts(st: dict | None) -> dict:
    return {name: (tuple(ranks), n) for name, ranks, n in (st or {}).get("counts") or []}


class _View:
    """Peers' statuses, each read once per look (a slow path: only after a whole fault timeout)."""

    def __init__(self, j, me: int, mine: dict):
        self.j, self.cache = j, {me: mine}

    def get(self, r: int):
        if r not in self.cache:
            self.cache[r] = peers.statuses(self.j, [r])[r]
        return self.cache[r]

    def waits_for(self, r: int) -> list[tuple[int, str]]:
        """(peer, group) pairs where rank r has issued more than the peer: r waits for it there."""
        out = []
        for name, (ranks, n) in _counts(self.get(r)).items():
            for q in ranks:
                if q == r:
                    continue
                st = self.get(q)
                if st is None or st.get("store_gone"):
                    continue
                theirs = _counts(st).get(name)
                if theirs is not None and theirs[1] < n:
                    out.append((q, name))
        return out


def find(j, me: int, mine: dict, timeout_s: float, compile_timeout_s: float) -> tuple[str, list[int]] | None:
    """(report, stuck ranks) when this rank waits, through any chain of waiting peers, for ranks that wait
    for nobody and have not issued anything for timeout_s (compile_timeout_s inside a compile or io entry).
    None while nothing is stuck, or while a peer is gone (the watchdog's other checks name that)."""
    view = _View(j, me, mine)
    first = view.waits_for(me)
    if not first:
        return None
    roots, seen, frontier, via = {}, {me}, [me], {}
    while frontier:
        r = frontier.pop()
        for q, group in view.waits_for(r):
            if q in seen:
                continue
            seen.add(q)
            via[q] = (r, group)
            st = view.get(q)
            if peers.gone(j, q, st):
                return None  # a dead or silent peer: the gone-rank checks report it
            if view.waits_for(q):
                frontier.append(q)
            else:
                roots[q] = st
    stuck = {}
    for q, st in roots.items():
        patience = compile_timeout_s if st.get("patient") else timeout_s
        if st.get("idle_s", 0.0) >= patience and not _in_a_stall(view, q):
            stuck[q] = st
    if not stuck:
        return None
    lines = []
    for q, st in sorted(stuck.items()):
        r, group = via[q]
        through = _through(via, q, me)
        chain = f" (this rank waits for it through rank(s) {through})" if through else ""
        lines.append(f"rank {q}{peers.where_suffix(st.get('where'))} is alive but has issued no collective for "
                     f"{st.get('idle_s', 0):.0f} s while rank {r} waits for it on group {_ranks(view, r, group)}"
                     f"{chain}; {position(st)}")
    return "; ".join(lines), sorted(stuck)


def _in_a_stall(view, q: int) -> bool:
    """Rank q waits in a collective whose group's every rank is alive and waits in one of the group's
    collectives too, as many issued on each: a stall, which its ranks find and report themselves (`stall`),
    naming every rank's position. Not a rank stuck outside its collectives: a rank waiting for it waits for
    their reports (its own collective then fails, naming what they posted), rather than ending the rank."""
    opened = (view.get(q) or {}).get("open") or {}
    group = tuple(opened.get("group") or ())
    if opened.get("kind") != "collective" or not group:
        return False
    seqs = set()
    for r in group:
        st = view.get(r)
        theirs = (st or {}).get("open") or {}
        if st is None or st.get("store_gone") or peers.gone(view.j, r, st) or theirs.get("kind") != "collective" \
                or tuple(theirs.get("group") or ()) != group:
            return False
        seqs.add((st.get("seqs") or {}).get(str(list(group))))
    return len(seqs) == 1 and None not in seqs


def _ranks(view, r, group) -> list:
    return list(_counts(view.get(r)).get(group, ((), 0))[0])


def _through(via: dict, q: int, me: int) -> list[int]:
    """The waiting ranks between this one and q (empty when this rank waits for q directly)."""
    hops, r = [], via[q][0]
    while r != me:
        hops.append(r)
        r = via[r][0]
    return hops[::-1]


def position(st: dict) -> str:
    """Where a rank is, from its status: its open journal entry and for how long, or its last one."""
    opened = st.get("open")
    if opened:
        return f"it has been in '{opened['what']}' for {st.get('open_age_s', 0):.0f} s"
    last = st.get("last")
    if last:
        return (f"it is outside gradsched (in the training script's own code) since '{last['what']}' "
                f"{last['state']} {st.get('last_age_s', 0):.0f} s ago")
    return "it has not entered gradsched yet"


# ---- what the watchdog thread does with it, each beat -------------------------------------------

def track_counts(j) -> None:
    counts = my_counts(j)
    if counts != j.counts:
        j.counts, j.counts_moved = counts, time.monotonic()


def name_the_stuck(j, me: int, end) -> bool:
    """This rank has issued nothing for the fault timeout, and waits (maybe through other waiting ranks) for an
    alive rank that issues nothing either: name it with its position and stack, and end (`end`: the watchdog's)."""
    found = find(j, me, j.status(), j.timeout_s, j.compile_timeout_s)
    if found is None:
        return False
    text, ranks = found
    j.ending = True
    for r in ranks:
        request_stack(j, r, me, text)
    stacks = "\n".join(f"Rank {r}'s stack (most recent call last):\n"
                       f"{read_stack(j, r, 4 * peers.INTERVAL_S) or '    (no answer)'}" for r in ranks)
    end(j, f"{j.where or f'rank {me}'} waits for a rank that is alive but stuck or slow beyond fault_timeout_s="
            f"{j.timeout_s:g}: {text}.\n{stacks}\nThis rank's last entries:\n{j.trace()}", post_all=False)
    return True


def answer_stack_request(j, me: int, end) -> None:
    """A peer found the job waiting for this rank: send it this rank's stack, say so, and end (exit code 3)."""
    request = _stack_request(j, me)
    if request is None:
        return
    j.ending = True
    time.sleep(4 * peers.INTERVAL_S)  # the ranks that asked read the stack and end first, with their own report
    end(j, f"{j.where or f'rank {me}'} is the rank the job waits for: rank {request['by']} found it "
            f"alive but issuing no collective for longer than fault_timeout_s={j.timeout_s:g} "
            f"({position(j.status())}); it ends here.\nIts stack (most recent call last):\n"
            f"{main_thread_stack()}\nThis rank's last entries:\n{j.trace()}", post_all=None)  # they know


def stall(j, waiting, me: int) -> str | None:
    """The stall report, when every peer of the group is alive and waits in a collective of the group too, each
    having issued as many collectives there as this rank (one that issued fewer is slow or stuck: `find`)."""
    st = peers.statuses(j, [r for r in waiting.group if r != me])
    for r, s in st.items():  # a peer that found the stall first has posted it, still waiting: it counts
        opened = (s or {}).get("open") or {}
        if s is None or s.get("store_gone") or peers.gone(j, r, s) or opened.get("kind") != "collective" or \
                tuple(opened.get("group") or ()) != waiting.group:
            return None
    seqs = {me: sequence_number(j.groups.get(waiting.group))}
    seqs.update({r: s["seqs"].get(str(list(waiting.group))) for r, s in st.items()})
    if None not in seqs.values() and len(set(seqs.values())) > 1:
        return None  # a rank has not issued its collective yet: it is slow or stuck (gradsched.sync.stuck names it)
    lines = [f"rank {me}{peers.where_suffix(j.where)}: #{waiting.seq} '{waiting.what}', collective {seqs[me]} of the group"]
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
    return (f"{j.where or f'rank {me}'}: the collectives of ranks {list(waiting.group)} have not progressed "
            f"for {time.monotonic() - waiting.started:.0f} s (fault_timeout_s={j.timeout_s:g}), every rank "
            f"alive and waiting; {verdict}.\n  " + "\n  ".join(lines) +
            f"\nThis rank's last entries:\n{j.trace()}")


def sequence_number(pg) -> int | None:
    """How many collectives and p2p operations this rank has issued on `pg` (c10d's count; None if it keeps none)."""
    try:
        return pg._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001
        return None


def watch_compiles(j) -> None:
    """Count Dynamo's compiles under way in j.compiling (its callbacks: its trace too, before any backend):
    a rank compiling is given compile_timeout_s. Once per process."""
    if _COMPILE_CALLBACKS:
        return
    from torch._dynamo.callback import callback_handler

    def compiling(n: int) -> None:
        j.compiling = max(0, j.compiling + n)
    _COMPILE_CALLBACKS.append(callback_handler.register_start_callback(lambda args: compiling(+1)))
    _COMPILE_CALLBACKS.append(callback_handler.register_end_callback(lambda args: compiling(-1)))


_COMPILE_CALLBACKS = []


# ---- the stack of a named rank, through the store ---------------------------------------------

def request_stack(j, rank: int, by: int, why: str) -> None:
    j.store.set(f"gradsched/stack_request/{rank}", json.dumps({"by": by, "why": why}))


def read_stack(j, rank: int, wait_s: float) -> str | None:
    key = f"gradsched/stack/{rank}"
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if j.store.check([key]):
                return j.store.get(key).decode()
        except Exception:  # noqa: BLE001 - the store's host may be the rank that is ending
            return None
        time.sleep(peers.INTERVAL_S / 2)
    return None


def _stack_request(j, me: int) -> dict | None:
    """If a peer asked for this rank's stack, write its main thread's Python stack and return the request."""
    key = f"gradsched/stack_request/{me}"
    if not j.store.check([key]):
        return None
    request = json.loads(j.store.get(key))
    j.store.set(f"gradsched/stack/{me}", main_thread_stack())
    return request


def main_thread_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "    (no main thread)"
    return "".join(traceback.format_stack(frame)[-STACK_FRAMES:]).rstrip()
