"""Which elements of which parameter a rank's shard of each bucket holds.

A bucket is its parameters' flattened gradients laid end to end (padded), cut into
`shards` equal parts over the gradient group; rank k of the group reduces part k. A
Piece names one parameter's elements inside one such part, so the optimizer, the
gradient clipping and checkpoints can speak of parameters, not of flat buckets.
Pure bookkeeping over the SyncPlan's layout: nothing here touches a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradsched.passes.bucketing import BucketLayout, owned_range


@dataclass(frozen=True)
class Piece:
    name: str  # the parameter, as the plan names it
    bucket: int  # the bucket's index in the layout
    lo: int  # elements [lo, hi) of the flattened parameter ...
    hi: int
    at: int  # ... start here in this rank's shard of the bucket

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def owned_pieces(layout: BucketLayout, shard: int) -> list[Piece]:
    """The pieces shard `shard` holds, in bucket and slot order (parameters it holds no element
    of are left out)."""
    pieces = []
    for b in layout.buckets:
        start = shard * b.shard_numel(layout.shards)
        for s in b.slots:
            lo, hi = owned_range(b.numel, s.offset, s.numel, layout.shards, shard)
            if lo < hi:
                pieces.append(Piece(s.name, b.index, lo, hi, s.offset + lo - start))
    return pieces
