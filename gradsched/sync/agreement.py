"""Every compiled graph agrees with its peers' on each group's collectives, on every run.

`with_agreement(gm, what)` returns a copy of a graph opened by `passes.agreement`: before its
first collective on a group, the graph all-gathers the digest of its sequence on that group and
runs `gradsched::agree` on the result. The graph gradsched built stays as it was (the verifier,
the report and the sync graphs' first-run check read it).

`gradsched::agree` raises CollectiveMismatch, on every rank of the group, when the digests
differ: each rank has published its sequences to the job's store at compile time, keyed by
group, rank and digest, so the message names both sides' graphs and their first differing
collective. Published at compile time, read only on a mismatch: a run that agrees costs one
8-byte all-gather per group, and on a GPU one device-to-host read of it.
"""
from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist
import torch.fx as fx

from gradsched.passes.agreement import AgreementSpec, insert_agreement
from gradsched.passes.graph_utils import collective_group, is_collective
from gradsched.sync.fingerprint import CollectiveMismatch, describe, first_difference

READ_TIMEOUT_S = 5.0  # a peer's published sequence: written long before, at its compile
_OWN: dict[tuple[str, int], dict] = {}  # (group, digest) -> what this rank published


@torch.library.custom_op("gradsched::agree", mutates_args=())
def agree(gathered: torch.Tensor, digest: int, group: str) -> torch.Tensor:
    """A float32 zero on `gathered`'s device when every rank's digest is `digest`; raises otherwise."""
    found = gathered.tolist()
    if any(d != digest for d in found):
        raise CollectiveMismatch(_mismatch(found, digest, group))
    return torch.zeros((), dtype=torch.float32, device=gathered.device)


@agree.register_fake
def _(gathered, digest, group):
    return gathered.new_zeros((), dtype=torch.float32)


def with_agreement(gm: fx.GraphModule, what: str) -> fx.GraphModule:
    """A copy of `gm` whose every group's collectives open with the agreement; `what` names the graph
    in messages ("the forward graph of stage 0")."""
    copy = fx.GraphModule(gm, gm.graph.__deepcopy__())
    copy.meta.update(gm.meta)
    groups = {collective_group(n) for n in gm.graph.nodes if is_collective(n)}
    if not groups:
        return copy
    sizes = {g: _resolve(g).size() for g in groups}
    _, record = insert_agreement(copy, AgreementSpec(torch.ops.gradsched.agree.default, sizes))
    for g, d in record.digests.items():
        _publish(g, d, {"what": what, "seq": record.sequences[g]})
    return copy


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


def _read(group: str, rank: int, digest: int) -> dict | None:
    store, key = _store(), _key(group, rank, digest)
    try:
        store.wait([key], datetime.timedelta(seconds=READ_TIMEOUT_S))
        return json.loads(store.get(key))
    except Exception:  # noqa: BLE001 - the store lives in rank 0's process, which may be leaving too
        return None


def _mismatch(found: list[int], digest: int, group: str) -> str:
    ranks = dist.get_process_group_ranks(_resolve(group))
    me = dist.get_rank()
    mine = _OWN[(group, digest)]
    other_rank = next(r for r, d in zip(ranks, found) if d != digest)
    other = _read(group, other_rank, found[ranks.index(other_rank)])
    differ = sorted({r for r, d in zip(ranks, found) if d != digest})
    head = (f"ranks {ranks} are about to run different collectives on one group: this rank ({me}) runs "
            f"{mine['what']}, {len(mine['seq'])} collective(s) on the group; ")
    if other is None:
        side = (f"rank(s) {differ} run(s) another graph, whose sequence could not be read from the job's "
                "store (its process may have ended).")
    else:
        i = first_difference(mine["seq"], other["seq"])
        at = lambda s: tuple(s[i]) if i < len(s) else None  # noqa: E731
        side = (f"rank {other_rank} runs {other['what']}, {len(other['seq'])} collective(s). At collective #{i} "
                f"rank {me} issues {describe(at(mine['seq']))} but rank {other_rank} issues "
                f"{describe(at(other['seq']))}.")
    return (head + side + " Nothing of either graph has run on this group yet: running would hang or mix "
            "unrelated tensors. The ranks compiled different graphs: give every rank the same model, the same "
            "gradsched options and inputs of the same shapes (a recompile on some ranks only is fine as long as "
            "its collectives are the same).")
