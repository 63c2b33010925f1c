"""A rank's shard of a parameter under tensor parallelism, from its partition (passes.tensor_parallel.Partition)."""
from __future__ import annotations

import torch

from gradsched.passes.tp_layouts import take_chunk


def local_shard(full: torch.Tensor, partition, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's part of `full` (a new tensor): along `partition.dim`, in each of its `segments`
    equal blocks, the rank-th of tp equal chunks; a copy of `full` when replicated."""
    if partition.dim is None:
        return full.detach().clone()
    return take_chunk(full.detach(), partition.dim, partition.segments, tp, rank).clone()
