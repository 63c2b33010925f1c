"""Every compiled graph agrees with its peers' on each group's collectives, without a read per run.

A graph opened by `passes.agreement` (on the copy gradsched compiles, gradsched.sync.compile): before its first
collective on a group, the graph all-gathers the digest of its sequence on that group and runs
`gradsched::agree` on the result; the group's collectives take their input through the op's zero. The
graph gradsched built stays as it was (the verifier, the report and the sync graphs' first-run check
read it). Each rank publishes its sequences to the job's store at compile time, keyed by group, rank and
digest, so that a mismatch can name both sides' graphs and their first differing collective.

When the op reads the gathered digests:
- a digest's first run on this rank (a new graph: the first step, or a recompile) reads them at once and
  raises CollectiveMismatch before the graph issues any of the group's collectives; a rank that
  recompiles alone into other collectives therefore never issues them.
- after that it reads nothing: it returns NaN instead of zero when the digests differ, computed on the
  device, so no mismatched collective's result is a finite number, and adds the same zero or NaN to the
  step's flag (`take_step_flag`), which the step's one read at its end (gradsched.sync.nonfinite.check)
  reads with the rest: a step whose digests agree reads nothing more. It also queues a copy of the
  digests to the host (pinned, non-blocking on a GPU), compared there (`settle`) only to name a
  mismatch: when that read found the step non-finite, on a failed collective, by the watchdog when a
  collective stalls, and before a plain torch optimizer steps (the backend by name). A step that agrees
  thus costs one 8-byte all-gather per group per graph run, no wait for the device and no host read.
"""
from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradsched.passes.agreement import AgreementRecord, AgreementSpec
from gradsched.passes.graph_utils import collective_group, is_collective
from gradsched.sync.fingerprint import CollectiveMismatch, describe, first_difference
from gradsched.sync.peers import KNOWN_CAUSES

READ_TIMEOUT_S = 5.0  # a peer's published sequence: written long before, at its compile
MAX_PENDING = 4096  # copies noted and not yet dropped or compared: past this, wait for the device and compare
_OWN: dict[tuple[str, int], dict] = {}  # (group, digest) -> what this rank published
_READ: set[tuple[str, int]] = set()  # (group, digest) whose first run read the peers' digests at once
_PENDING: list[_Noted] = []  # copies of gathered digests not yet compared, oldest first
_LOCK = threading.Lock()  # over _PENDING: the watchdog's thread reads it too
_HOOK: list = []  # the optimizer step pre-hook (settle) once installed
_FLAGS: dict = {}  # device -> the sum of this step's agree results there: zero, or NaN once digests differed


@dataclass
class _Noted:
    host: torch.Tensor  # the gathered digests, on the host (or on their way there)
    done: object  # the copy's device event; None once it is on the host
    digest: int
    group: str

    def arrived(self) -> bool:
        return self.done is None or self.done.query()


@torch.library.custom_op("gradsched::agree", mutates_args=())
def agree(gathered: torch.Tensor, digest: int, group: str) -> torch.Tensor:
    """A float32 scalar on `gathered`'s device: zero when every rank's digest is `digest`, NaN when not (after
    the digest's first run, which raises CollectiveMismatch instead). Never waits for the device after that."""
    if gathered.is_meta:  # the dry run: nothing to compare
        return gathered.new_zeros((), dtype=torch.float32)
    if (group, digest) not in _READ:  # a new graph on this rank: check before it issues anything
        _compare(gathered.tolist(), digest, group, late=False)
        _READ.add((group, digest))
        return gathered.new_zeros((), dtype=torch.float32)
    _note(gathered, digest, group)
    flag = torch.where((gathered == digest).all(), 0.0, float("nan")).to(torch.float32)
    with _LOCK:
        _FLAGS[flag.device] = flag.clone() if flag.device not in _FLAGS else _FLAGS[flag.device] + flag
    return flag


@agree.register_fake
def _(gathered, digest, group):
    return gathered.new_zeros((), dtype=torch.float32)


def agreement_spec(gm: fx.GraphModule) -> AgreementSpec:
    """The spec of passes.agreement for `gm`: gradsched's check op and the size of each group it talks to."""
    groups = {collective_group(n) for n in gm.graph.nodes if is_collective(n)}
    return AgreementSpec(torch.ops.gradsched.agree.default, {g: _resolve(g).size() for g in groups})


def publish(record: AgreementRecord, what: str) -> None:
    """Each group's digest of a graph the pass opened, for the comparisons; `what` names the graph in messages
    ("the forward graph of stage 0")."""
    for g, d in record.digests.items():
        _publish(g, d, {"what": what, "seq": record.sequences[g]})
    if record.digests and not _HOOK:  # the backend by name: a plain torch optimizer applies nothing a mismatch produced
        _HOOK.append(register_optimizer_step_pre_hook(lambda *_: settle(wait=True)))


def settling(run):
    """A compiled graph's boxed callable that first compares the digests earlier runs gathered (those on the
    host already), and names a known mismatch when one of its collectives fails."""
    return _Settling(run)


class _Settling:
    _boxed_call = True

    def __init__(self, run):
        self.run = run

    def __call__(self, args):
        try:
            return self.run(args)
        except Exception as e:
            explain(e)
            raise

    def __getattr__(self, name):  # what the compiled callable offers (Inductor's source_code, ...)
        return getattr(self.run, name)


def take_step_flag(device: torch.device) -> torch.Tensor | None:
    """The sum, on `device`, of every agree result since the last call (zero, or NaN where digests differed), to
    read with the step's other flags; None when no graph ran an agreement. Reads nothing."""
    with _LOCK:
        flags = [f.to(device) for f in _FLAGS.values()]
        _FLAGS.clear()
    return sum(flags[1:], flags[0]) if flags else None


def forget() -> None:
    """Drop the queued copies unread: the step's flag, read with its end, showed every digest agreed."""
    with _LOCK:
        _PENDING.clear()


def settle(wait: bool = False) -> None:
    """Compare the digests gathered by earlier runs whose copy has reached the host (every one with
    wait=True, waiting for the device); raise CollectiveMismatch at the first that differs."""
    if not _PENDING:
        return
    with _LOCK:
        ready = [n for n in _PENDING if wait or n.arrived()]
        _PENDING[:] = [n for n in _PENDING if not any(n is r for r in ready)]
    for n in ready:
        if n.done is not None:
            n.done.synchronize()
        _compare(n.host.tolist(), n.digest, n.group)
    if wait:  # every digest compared and alike: the step's flag says nothing more
        with _LOCK:
            _FLAGS.clear()


def known_mismatch(store=None) -> str | None:
    """The message of a mismatch among the digests already on the host, or None; never waits for the device
    and raises nothing (the watchdog asks it when a collective stalls; `store`: its own connection)."""
    try:
        with _LOCK:
            noted = [n for n in _PENDING if n.arrived()]
        for n in noted:
            found = n.host.tolist()
            if any(d != n.digest for d in found):
                return _mismatch(found, n.digest, n.group, store)
    except Exception:  # noqa: BLE001 - a diagnosis never replaces the error it explains
        pass
    return None


KNOWN_CAUSES.append(lambda store: (CollectiveMismatch, m) if (m := known_mismatch(store)) else None)


def explain(exc: BaseException) -> None:
    """Raise CollectiveMismatch from `exc` (a failed collective, a peer gone) when the digests already show
    that the ranks ran different collectives: the failure's cause."""
    message = known_mismatch()
    if message is not None:
        with _LOCK:
            _PENDING.clear()
        raise CollectiveMismatch(message) from exc


def _note(gathered: torch.Tensor, digest: int, group: str) -> None:
    if gathered.device.type == "cuda":
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        host.copy_(gathered, non_blocking=True)  # ordered after the all-gather's wait on this stream
        done = torch.cuda.Event()
        done.record()
    elif gathered.device.type == "cpu":
        host, done = gathered.clone(), None  # Inductor may reuse the gathered buffer after the op
    else:  # another accelerator: a blocking copy (no event API relied upon here)
        host, done = gathered.to("cpu"), None
    with _LOCK:
        _PENDING.append(_Noted(host, done, digest, group))
        full = len(_PENDING) >= MAX_PENDING
    if full:  # graphs run without a step's end (no optimizer step): compare now rather than keep them all
        settle(wait=True)


def _compare(found: list[int], digest: int, group: str, late: bool = True) -> None:
    if any(d != digest for d in found):
        with _LOCK:
            _PENDING.clear()
        raise CollectiveMismatch(_mismatch(found, digest, group, late=late))


def _resolve(group: str):
    return dist.distributed_c10d._resolve_process_group(group)


def _key(group: str, rank: int, digest: int) -> str:
    return f"gradsched/agree/{group}/{rank}/{digest}"


def _publish(group: str, digest: int, entry: dict) -> None:
    rank = dist.get_rank()
    entry = json.loads(json.dumps(entry))  # tuples as lists, as a peer will read them
    _OWN[(group, digest)] = entry
    store = _store()
    if store is not None:
        store.set(_key(group, rank, digest), json.dumps(entry))


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default process group: nothing to publish to
        return None


def _read(group: str, rank: int, digest: int, store=None) -> dict | None:
    store, key = store or _store(), _key(group, rank, digest)
    try:
        store.wait([key], datetime.timedelta(seconds=READ_TIMEOUT_S))
        return json.loads(store.get(key))
    except Exception:  # noqa: BLE001 - the store lives in rank 0's process, which may be leaving too
        return None


def _mismatch(found: list[int], digest: int, group: str, store=None, late: bool = True) -> str:
    """late: found after the run (its collectives were issued) rather than before its first collective."""
    ranks = dist.get_process_group_ranks(_resolve(group))
    me = dist.get_rank()
    mine = _OWN[(group, digest)]
    other_rank = next(r for r, d in zip(ranks, found) if d != digest)
    other = _read(group, other_rank, found[ranks.index(other_rank)], store)
    differ = sorted({r for r, d in zip(ranks, found) if d != digest})
    head = (f"ranks {ranks} {'ran' if late else 'are about to run'} different collectives on one group: this "
            f"rank ({me}) runs {mine['what']}, {len(mine['seq'])} collective(s) on the group; ")
    if other is None:
        side = (f"rank(s) {differ} run(s) another graph, whose sequence could not be read from the job's "
                "store (its process may have ended).")
    else:
        i = first_difference(mine["seq"], other["seq"])
        at = lambda s: tuple(s[i]) if i < len(s) else None  # noqa: E731
        side = (f"rank {other_rank} runs {other['what']}, {len(other['seq'])} collective(s). At collective #{i} "
                f"rank {me} issues {describe(at(mine['seq']))} but rank {other_rank} issues "
                f"{describe(at(other['seq']))}.")
    when = ("Found after they ran (their results were made NaN on the device): nothing computed from them was "
            "applied." if late else "Nothing of either graph has run on this group yet: running would hang or mix "
            "unrelated tensors.")
    return (head + side + f" {when} The ranks compiled different graphs: give every rank the same model, the "
            "same gradsched options and inputs of the same shapes (a recompile on some ranks only is fine as long as its collectives are the same).")
