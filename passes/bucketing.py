"""Group gradients into flat buckets, in ready order, sized for a reduce-scatter; the last
bucket (which nothing can overlap) small.

Invariant: each bucket's numel is a multiple of `shards` (the data-parallel
group size), so a reduce-scatter splits it into equal shards, and a parameter
occupies one contiguous range [offset, offset + numel) of one bucket.

Buckets are filled from the end of the ready order: the last bucket (and, while
the buckets behind it hold tied gradients, the last untied one) holds at most
`tail_mb`, or the last gradient alone, since nothing is left to compute while it
is reduced (tests/test_bucketing.py).

With `align_ties`, a tied gradient gets a bucket of its own, of size
round_up(numel, shards): a size that depends only on the weight and the DP
size, so every stage holding a copy shards it identically and each rank owns
exactly 1/shards of it, which is what shard-aligned mode needs (the verifier
still checks it rather than trusting this). It also makes every copy's
reduce-scatter sum each element in the same order, so copies that start equal
stay bitwise equal.

`place_buckets` then says which graph reduces each bucket. Invariant: under
"tied_at_flush", a bucket holding a tied gradient is never placed in the backward graph
(its tie all-reduce spans stages, and a stage's backward cannot wait on another
stage before sending its input gradient: a deadlock); every other bucket is.
Every bucket is placed exactly once, and indices are kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .grad_ready_order import GradSpec


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    tie: str | None = None  # the tie key when this gradient is a tied copy


@dataclass(frozen=True)
class Bucket:
    index: int
    slots: tuple[Slot, ...]
    numel: int  # padded
    dtype: torch.dtype  # dtype the bucket is reduced in

    def shard_numel(self, shards: int) -> int:
        return self.numel // shards


@dataclass(frozen=True)
class BucketLayout:
    buckets: tuple[Bucket, ...]
    shards: int

    def locate(self, name: str) -> tuple[Bucket, Slot]:
        for b in self.buckets:
            for s in b.slots:
                if s.name == name:
                    return b, s
        raise KeyError(name)

    def describe(self) -> list[dict]:
        return [{"bucket": b.index, "numel": b.numel, "dtype": str(b.dtype),
                 "slots": [(s.name, s.offset, s.numel) for s in b.slots]} for b in self.buckets]


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def owned_range(bucket_numel: int, offset: int, numel: int, shards: int, shard: int) -> tuple[int, int]:
    """Elements [lo, hi) of a parameter at `offset` that shard `shard` owns (lo == hi: none)."""
    size = bucket_numel // shards
    lo = max(offset, shard * size)
    hi = min(offset + numel, (shard + 1) * size)
    return (lo - offset, hi - offset) if lo < hi else (0, 0)


TAIL_MB = 1.0  # the last bucket's cap: what no remaining compute can hide (DDP caps its first bucket so)


def plan_buckets(ready: list[GradSpec], *, bucket_mb: float, shards: int,
                 reduce_dtype: torch.dtype | None = None, ties: dict[str, str] | None = None,
                 align_ties: bool = False, tail_mb: float = TAIL_MB) -> BucketLayout:
    """ready: gradients in ready order; ties: parameter name -> tie key.

    Buckets are filled from the END of the ready order: the last bucket is reduced after the
    backward's last kernel, with nothing left to hide it, so it is capped at `tail_mb` (and holds
    at least the last gradient). Until a bucket without a tied gradient is closed, the cap stays
    at `tail_mb`: under placement="tied_at_flush" tied buckets move to the flush, and the last bucket the
    backward itself reduces is the first untied one. The others are capped at `bucket_mb`.
    """
    ties = ties or {}
    groups: list[list[tuple[GradSpec, torch.dtype]]] = []
    cur: list[tuple[GradSpec, torch.dtype]] = []
    exposed = True

    def close():
        nonlocal cur, exposed
        if cur:
            groups.append(cur)
            exposed = exposed and any(ties.get(sp.name) for sp, _ in cur)
        cur = []

    for spec in reversed(ready):
        dtype = reduce_dtype or spec.dtype
        mb = min(tail_mb, bucket_mb) if exposed else bucket_mb
        cap = max(1, int(mb * 2**20) // dtype.itemsize)
        alone = bool(ties.get(spec.name)) and align_ties
        used = sum(sp.numel for sp, _ in cur)
        if cur and (dtype != cur[0][1] or used + spec.numel > cap or alone or
                    align_ties and ties.get(cur[0][0].name)):
            close()
        cur.insert(0, (spec, dtype))
    close()

    buckets = []
    for group in reversed(groups):  # back to ready order: bucket 0 is reduced first
        slots, used = [], 0
        for spec, _ in group:
            slots.append(Slot(spec.name, used, spec.numel, spec.shape, spec.dtype, ties.get(spec.name)))
            used += spec.numel
        buckets.append(Bucket(len(buckets), tuple(slots), round_up(used, shards), group[0][1]))
    return BucketLayout(tuple(buckets), shards)


def place_buckets(layout: BucketLayout, placement: str) -> dict[str, BucketLayout]:
    """"backward" and/or "flush" -> the sub-layout that graph reduces (no empty one).

    placement: "tied_at_flush" (tied buckets at the flush, the others in the backward), "backward"
    or "flush" (every bucket there)."""
    if placement in ("backward", "flush"):
        parts = {placement: layout.buckets}
    elif placement == "tied_at_flush":
        tied = tuple(b for b in layout.buckets if any(s.tie for s in b.slots))
        parts = {"backward": tuple(b for b in layout.buckets if b not in tied), "flush": tied}
    else:
        raise ValueError(f"placement={placement!r}: one of 'tied_at_flush', 'backward', 'flush'.")
    return {where: BucketLayout(buckets, layout.shards) for where, buckets in parts.items() if buckets}


def place_after(layout: BucketLayout, final_at: dict[str, int], points: int) -> dict[str, BucketLayout]:
    """Several stage graphs on one rank, each done with the step at its own point of the schedule (0 to
    points - 1, in the order they finish; `final_at`: gradient name -> the point its last writer finishes):
    "early{j}" -> the buckets whose every gradient is final at point j, for each j before the last; "flush" ->
    the rest: the last point's (nothing is left to overlap them with) and every bucket holding a tied gradient
    (its tie all-reduce is matched with another rank's copy, at the schedule's end)."""
    parts: dict[str, list] = {}
    for b in layout.buckets:
        j = max(final_at[s.name] for s in b.slots)
        where = "flush" if j >= points - 1 or any(s.tie for s in b.slots) else f"early{j}"
        parts.setdefault(where, []).append(b)
    return {where: BucketLayout(tuple(bs), layout.shards) for where, bs in parts.items()}
