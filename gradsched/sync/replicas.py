"""Replicas start equal, or the job refuses: once, at setup, before any step.

Each pipeline stage is held by dp x cp ranks (the plan's "grad" group; dp x cp x tp whole tensors, its "stage"
group, before each TP rank cuts its shards from them), which reduce the same gradients into
their own copies of its parameters: copies that begin apart stay apart, and the run trains silently wrong (a
replica built from another seed, or by other code). `make_replicas_equal(module, plan)`, called by every rank of
the plan with its stage's module, guarantees when it returns:

- structure: every replica of a stage holds the same parameters and buffers, in the same order, with the same
  names, shapes, dtypes, requires_grad and ties (each name of a shared tensor is listed, with the first name it
  shares: remove_duplicate=False). A difference is refused on EVERY rank of the plan, before any value is sent,
  by one ReplicaMismatch, the same text everywhere: the ranks of the other stages would otherwise wait for this
  stage in the schedule. It names each differing rank with its plan coordinates, the stage's first replica it
  was compared with, and their first differing parameter or buffer.
- values: every parameter and buffer of a stage is its first replica's (DDP's convention: the group's rank 0),
  bit for bit; ties stay ties (a tensor is sent once, whatever its names).

Cost, once per run: one all-gather of one int64 per rank over the plan (the digests of every rank's structure
description; a rank compares only with its own stage's replicas); then, per stage group, one broadcast per
BUCKET_BYTES of each dtype (each tensor once: the stage's parameter and buffer bytes, no more). Only on a
mismatch, one all_gather_object of every rank's description, to name the difference. Every collective is a
journal entry (gradsched.sync.watchdog), so a fault there is named. A plan of one replica per stage
(dp x cp == 1), or no process group, does nothing at all.
"""
from __future__ import annotations

import hashlib
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsched.sync.param_shards import all_gather
from gradsched.sync.watchdog import JOURNAL

BUCKET_BYTES = 256 * 2**20  # one broadcast carries up to this many bytes of one dtype (a larger tensor: alone)
SHOWN = 3  # differing ranks named in the message


class ReplicaMismatch(ValueError):
    """The data- or context-parallel replicas of a pipeline stage hold different parameters or buffers."""


def make_replicas_equal(module: nn.Module, plan) -> None:
    """Check that every replica of this rank's stage holds `module`'s structure, then broadcast its parameters and
    buffers from the stage's first replica (see the module docstring). Every rank of `plan` calls it, at the
    same point, with its own stage's module, before any graph of it runs or shards it."""
    make_tensors_equal(named_tensors(module), plan)


def named_tensors(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) of every parameter and buffer, every name of a shared one included."""
    return ([("parameter", n, p) for n, p in module.named_parameters(remove_duplicate=False)] +
            [("buffer", n, b) for n, b in module.named_buffers(remove_duplicate=False)])


def make_tensors_equal(named: list[tuple[str, str, torch.Tensor]], plan) -> None:
    """make_replicas_equal on (kind, name, tensor) triples (the backend by name sees a graph's inputs, no module)."""
    if not dist.is_initialized() or plan.stage_replicas * plan.tp == 1:
        return
    entries = describe(named)
    world_group = plan.group or dist.group.WORLD
    device = next((t.device for _, _, t in named if not t.is_meta), None) or _comm_device(world_group)
    mine = digest(entries)
    digests = torch.full((plan.world,), mine, dtype=torch.int64, device=device)  # a fake group leaves it: equal
    with JOURNAL.entry("the structure digests of every stage's replicas (their parameters and buffers)",
                       "collective", world_group, "all_gather", plan.world, torch.int64):
        all_gather(digests, torch.tensor([mine], dtype=torch.int64, device=device), world_group)
    found = digests.tolist()
    # the tensors are whole (TP ranks cut their shards later): a stage's every rank starts from its first's
    firsts = {r: plan.rank_of(plan.index("pp", r), 0) for r in range(plan.world)}
    if any(found[r] != found[firsts[r]] for r in range(plan.world)):
        described = [None] * plan.world
        with JOURNAL.entry("every rank's parameters and buffers, to name the replicas that differ", "collective",
                           world_group, "all_gather_object", plan.world, "object"):
            dist.all_gather_object(described, (plan.describe(), entries), group=world_group)
        raise ReplicaMismatch(mismatch_message(described, firsts, found))
    _broadcast(named, plan)


def describe(named) -> list[tuple]:
    """What must be equal on every replica: (kind, name, shape, dtype, requires_grad, the first name of the same
    tensor or '') per name, in the module's order."""
    first, out = {}, []
    for kind, name, t in named:
        alias = first.setdefault(id(t), name)
        out.append((kind, name, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                    bool(t.requires_grad) if kind == "parameter" else None, "" if alias == name else alias))
    return out


def digest(entries: list[tuple]) -> int:
    return int.from_bytes(hashlib.sha256(repr(entries).encode()).digest()[:8], "little", signed=True)




def _comm_device(group) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- the refusal ------------------------------------------------------------------------------------------------
def _entry(e: tuple) -> str:
    kind, name, shape, dtype, requires_grad, alias = e
    return (f"{kind} {name!r} {shape} {dtype}" + (" (frozen)" if requires_grad is False else "") +
            (f" (the tensor of {alias!r})" if alias else ""))


def first_difference(mine: list[tuple], first: list[tuple], me: str, them: str) -> str:
    """The first entry where `mine` (rank `me`'s) and `first` (the stage's first replica's) differ, in words."""
    for a, b in itertools.zip_longest(mine, first):
        if a != b:
            break
    else:
        return "nothing (their digests differ only)"
    names_a, names_b = {e[1] for e in mine}, {e[1] for e in first}
    extra, missing = len(names_a - names_b), len(names_b - names_a)
    count = f" ({extra} name(s) only on {me}, {missing} only on {them})" if extra or missing else ""
    if a is not None and b is not None and a[:2] == b[:2]:
        return f"{_entry(a)} on {me}, but {_entry(b)} on {them}"
    if a is not None and a[1] not in names_b:
        return f"{_entry(a)} on {me}, which {them} does not hold{count}"
    if b is not None and b[1] not in names_a:
        return f"no {_entry(b)} on {me}, which {them} holds{count}"
    if a is None or b is None:  # a name listed once more on one side (a tie there, two tensors here)
        extra_one = a if a is not None else b
        return f"{_entry(extra_one)} listed once more on {me if a is not None else them}"
    return f"{a[0]} {a[1]!r} on {me} where {them} holds {b[0]} {b[1]!r} (the same names in another order)"


def mismatch_message(described: list, firsts: dict, found: list) -> str:
    """The same text on every rank, from every rank's (plan.describe(), entries)."""
    odd = [r for r in range(len(found)) if found[r] != found[firsts[r]]]
    lines = []
    for r in odd[:SHOWN]:
        (me, mine), (them, first) = described[r], described[firsts[r]]
        lines.append(f"{me} differs from its stage's first replica, {them}: first difference: "
                     f"{first_difference(mine, first, me.split('/')[0], them.split('/')[0])}")
    more = f"\n  ... and {len(odd) - SHOWN} more rank(s) of {odd}" if len(odd) > SHOWN else ""
    return ("gradsched: the data/context-parallel replicas of a pipeline stage must hold the same parameters and "
            "buffers (names, shapes, dtypes, ties), and these do not; nothing was sent, no step ran:\n  " +
            "\n  ".join(lines) + more +
            "\nBuild the model the same way on every rank (same code, config and split points); its values need not "
            "agree: gradsched broadcasts them from each stage's first replica.")


# ---- the values ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def _broadcast(named, plan) -> None:
    """Every tensor (once, however many names it has) from the stage's first replica, in buckets of one dtype
    and device of up to BUCKET_BYTES: few collectives, and at most one bucket's extra memory at a time."""
    group = plan.process_group("stage")
    src = plan.global_rank(plan.group_ranks("stage")[0])
    seen, by_kind = set(), {}
    for _, _, t in named:
        if id(t) in seen or t.is_meta or t.numel() == 0:
            continue
        seen.add(id(t))
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    buckets = []
    for tensors in by_kind.values():
        bucket, size = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        buckets.append(bucket)
    receiving = plan.rank != plan.group_ranks("stage")[0]
    stage = plan.stage
    for i, bucket in enumerate(buckets):
        alone = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0].detach().view(-1) if alone else torch.cat([t.detach().reshape(-1) for t in bucket])
        wire = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
        with JOURNAL.entry(f"stage {stage}'s parameters and buffers from its first replica (rank {src}), bucket "
                           f"{i + 1} of {len(buckets)}", "collective", group, "broadcast", wire.numel(), wire.dtype):
            dist.broadcast(wire, group=group, group_src=0)
        if receiving and not alone:
            for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(piece.view_as(t))
