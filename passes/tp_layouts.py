"""How a value is laid out over the TP group, and how shape ops move that layout.

A layout says which dimension of a value (in its whole, one-process shape) each TP rank holds a
chunk of:

  FULL               every rank holds all of it (the same values, or inputs every rank has)
  Seq(dim)           sequence parallelism: the rank-th of tp chunks of the token dimension
  Shard(dim, segs)   tensor parallelism: `dim` is `segs` equal blocks (a fused q/k/v projection's
                     three), and the rank holds the rank-th of tp chunks of each block
  PARTIAL            every rank holds a summand of the value (a row-parallel product, a
                     vocab-parallel lookup) until it is reduced

The rules here are pure shape arithmetic on whole shapes, so the pass can reason about a graph
traced in one process before any rank's shapes exist.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class TensorParallelError(ValueError):
    """A graph the tensor-parallel pass cannot split correctly, named at its source line."""


@dataclass(frozen=True)
class Layout:
    kind: str  # "full" | "seq" | "shard" | "partial"
    dim: int | None = None
    segments: int = 1

    @property
    def split(self) -> bool:
        return self.kind in ("seq", "shard")

    def at(self, dim: int) -> "Layout":
        return Layout(self.kind, dim, self.segments)

    def __str__(self):
        return self.kind if self.dim is None else f"{self.kind}({self.dim}{f', x{self.segments}' if self.segments > 1 else ''})"


@dataclass(frozen=True)
class Partition:
    """How a parameter is split over TP: its `dim` (None: replicated) in `segments` blocks, each split in tp."""
    role: str  # "column" | "row" | "vocab" | "replicated"
    dim: int | None = None
    segments: int = 1


REPLICATED = Partition("replicated")
FULL = Layout("full")
# higher-order ops whose body runs inline, once (activation checkpointing recomputes it in the backward,
# collectives included, alike on every rank)
BODIES = {torch.ops.higher_order.tag_activation_checkpoint, torch.ops.higher_order.wrap}
PARTIAL = Layout("partial")


def Seq(dim: int) -> Layout:
    return Layout("seq", dim)


def Shard(dim: int, segments: int = 1) -> Layout:
    return Layout("shard", dim, segments)


def local_shape(shape, layout: Layout, tp: int) -> tuple[int, ...]:
    """A rank's shape of a value of whole shape `shape` laid out as `layout`."""
    shape = list(shape)
    if layout.split:
        shape[layout.dim] //= tp
    return tuple(shape)


def check_divisible(size: int, layout: Layout, tp: int, what: str) -> None:
    if size % (layout.segments * tp):
        raise TensorParallelError(f"{what}: its size {size} is not divisible by tp={tp}"
                                  f"{f' x {layout.segments} blocks' if layout.segments > 1 else ''}")


def view_dim(in_shape, out_shape, dim: int, segments: int, tp: int) -> int | None:
    """The output dimension that carries input dimension `dim`'s chunks through a view/reshape from
    `in_shape` to `out_shape` (whole shapes), or None when the chunks do not stay whole along one
    output dimension (a split dimension that is not the most major of the dimensions it merges with,
    or that splits into dimensions none of which it divides)."""
    i = o = 0
    while i < len(in_shape) or o < len(out_shape):
        i0, o0 = i, o
        pi = in_shape[i] if i < len(in_shape) else 1
        po = out_shape[o] if o < len(out_shape) else 1
        i, o = i + 1, o + 1
        while pi != po:
            if pi < po:
                pi *= in_shape[i]
                i += 1
            else:
                po *= out_shape[o]
                o += 1
        ins = [d for d in range(i0, i) if in_shape[d] != 1]
        outs = [d for d in range(o0, min(o, len(out_shape))) if out_shape[d] != 1]
        if dim not in range(i0, i):
            continue
        if in_shape[dim] == 1 or not outs:
            return None
        if ins[0] != dim:
            return None  # the chunks of a minor dimension are strided in the merged one
        first = outs[0]
        return first if out_shape[first] % (segments * tp) == 0 else None
    return None


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def aligned_dim(out_ndim: int, operand_ndim: int, operand_dim: int) -> int:
    """The output dimension an operand's dimension broadcasts to (shapes aligned on the right)."""
    return operand_dim + out_ndim - operand_ndim


def numel(shape) -> int:
    return math.prod(shape)


def take_chunk(x, dim: int, segments: int, tp: int, rank: int):
    """The rank-th of tp chunks of each of `segments` equal blocks of `x` along `dim`: what a rank holds
    of a value laid out Shard(dim, segments) (or Seq(dim), one block). Traced into graphs and used on
    parameters alike, so the graph's slices and the parameters' shards agree."""
    n = x.shape[dim]
    return x.unflatten(dim, (segments, tp, n // (segments * tp))).select(dim + 1, rank).flatten(dim, dim + 1)
