"""Where a rank's values lie in a whole parameter, as DCP's n-dimensional chunks.

A checkpoint keys every parameter (and its optimizer state) whole, in its own shape, so that any layout reads
it. A rank holds a part of it: a TP shard (its chunk of `partition.dim` in each of `partition.segments`
blocks), and of that, under shard=True, a flat range [lo, hi) (a bucket's piece). Such a part is a few boxes
of the whole tensor: `chunks` finds them (a flat range of a C-ordered tensor is at most two partial rows and
a block of whole rows, at every level; a box is then cut where it crosses a TP segment), each with the view
of the rank's values it stands for. DCP reads, for each requested box, whatever saved boxes overlap it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    offsets: tuple  # in the whole tensor
    sizes: tuple
    start: int  # the rank's values: flat [start, end) of its part, viewed as `box`, narrowed along `dim`
    end: int
    box: tuple
    dim: int | None = None
    narrow: tuple = (0, 0)  # (from, length) along dim

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This chunk's values in `flat` (the part's values from its `lo`, flattened)."""
        v = flat[self.start:self.end].view(self.box)
        return v if self.dim is None else v.narrow(self.dim, *self.narrow)


def flat_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[int, int, tuple, tuple]]:
    """Elements [lo, hi) of a C-ordered tensor of `shape` as boxes: (start, end, offsets, sizes), in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [(lo, hi, (lo,), (hi - lo,))] if shape else [(0, 1, (), ())]
    inner, rest = math.prod(shape[1:]), tuple(shape[1:])
    out = []

    def partial_row(row, a, b):  # [a, b) inside one row
        out.extend((s + row * inner, e + row * inner, (row, *o), (1, *z))
                   for s, e, o, z in flat_boxes(rest, a - row * inner, b - row * inner))

    if lo % inner:
        end = min(hi, (lo // inner + 1) * inner)
        partial_row(lo // inner, lo, end)
        lo = end
    whole_rows_end = hi // inner * inner
    if lo < whole_rows_end:
        out.append((lo, whole_rows_end, (lo // inner,) + (0,) * len(rest), ((whole_rows_end - lo) // inner, *rest)))
        lo = whole_rows_end
    if lo < hi:
        partial_row(lo // inner, lo, hi)
    return out


def chunks(part_shape: tuple, lo: int, hi: int, partition=None, tp: int = 1, tp_rank: int = 0) -> list[Chunk]:
    """The chunks of the whole tensor that flat [lo, hi) of a part of shape `part_shape` holds: the part is TP
    rank `tp_rank`'s shard under `partition` (None or replicated: the part is the whole tensor). Starts and
    ends are relative to lo."""
    dim = None if partition is None else partition.dim
    out = []
    for s, e, offsets, sizes in flat_boxes(tuple(part_shape), lo, hi):
        if dim is None:
            out.append(Chunk(offsets, sizes, s - lo, e - lo, sizes))
            continue
        c = part_shape[dim] // partition.segments  # a segment's rows on one TP rank
        a0, a1 = offsets[dim], offsets[dim] + sizes[dim]
        for b in range(a0 // c, (a1 - 1) // c + 1):
            x0, x1 = max(a0, b * c), min(a1, (b + 1) * c)
            whole = list(offsets)
            whole[dim] = b * c * tp + tp_rank * c + (x0 - b * c)
            size = list(sizes)
            size[dim] = x1 - x0
            out.append(Chunk(tuple(whole), tuple(size), s - lo, e - lo, sizes, dim, (x0 - a0, x1 - x0)))
    return out


def whole_shape(part_shape: tuple, partition=None, tp: int = 1) -> tuple:
    if partition is None or partition.dim is None:
        return tuple(part_shape)
    shape = list(part_shape)
    shape[partition.dim] *= tp
    return tuple(shape)


def sharded_entry(whole: tuple, entries: list, local: list, dtype, device):
    """A DCP entry (ShardedTensor) of a tensor of shape `whole`: `entries` [(global rank, Chunk)] over the ranks
    that write it (reading: this rank's own), `local` this rank's chunks' tensors, in their order there. Only
    this rank's entries need be right: DCP plans writes and reads from each rank's own chunks."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    me = dist.get_rank()
    md = [ShardMetadata(list(c.offsets), list(c.sizes), f"rank:{r}/{device}") for r, c in entries]
    shards = [Shard(t, m) for t, m in zip(local, [m for m, (r, _) in zip(md, entries) if r == me])]
    meta = ShardedTensorMetadata(md, torch.Size(whole), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


class Reads:
    """Requests for the chunks of this rank's parts, and, after DCP's load, their values put in place: each
    chunk is read into a buffer of its own (a chunk's view of a part need not be contiguous)."""

    def __init__(self):
        self._todo = []  # (the part's flat values, chunk, buffer)

    def request(self, whole: tuple, entries: list, mine: list):
        """The entry reading a tensor of shape `whole`: `entries` [(global rank, Chunk)] covering it (a
        ShardedTensor must: each rank's own, the rest only declared), `mine` [(a part's flat values, Chunk)]
        this rank's, in the order its entries come."""
        todo = [(flat, c, torch.zeros(c.sizes, dtype=flat.dtype, device=flat.device)) for flat, c in mine]
        self._todo += todo
        flat = mine[0][0]
        return sharded_entry(whole, entries, [b for _, _, b in todo], flat.dtype, flat.device)

    @torch.no_grad()
    def put(self) -> None:
        for flat, c, buf in self._todo:
            c.view(flat).copy_(buf)
