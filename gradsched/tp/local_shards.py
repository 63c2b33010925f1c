"""A rank's shard of a parameter under tensor parallelism, from its placement (passes.tensor_parallel.Placement)."""
from __future__ import annotations

import torch

from gradsched.passes.tp_layouts import take_chunk


def local_shard(full: torch.Tensor, placement, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's part of `full` (a new tensor): along `placement.dim`, in each of its `segments`
    equal blocks, the rank-th of tp equal chunks; a copy of `full` when replicated."""
    if placement.dim is None:
        return full.detach().clone()
    return take_chunk(full.detach(), placement.dim, placement.segments, tp, rank).clone()
