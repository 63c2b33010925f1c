"""A rank's shards of a model's parameters under tensor parallelism, from their partitions
(passes.tp_layouts.Partition), and the whole parameters gathered back from them."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gradsched.passes.tp_layouts import take_chunk
from gradsched.sync.owners import mark_superseded


def local_shard(full: torch.Tensor, partition, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's part of `full` (a new tensor): along `partition.dim`, in each of its `segments`
    equal blocks, the rank-th of tp equal chunks; a copy of `full` when replicated."""
    if partition.dim is None:
        return full.detach().clone()
    return take_chunk(full.detach(), partition.dim, partition.segments, tp, rank).clone()


def whole_from_shards(shards: list[torch.Tensor], partition) -> torch.Tensor:
    """The inverse of local_shard over every rank's shard, in TP rank order."""
    dim, segments = partition.dim, partition.segments
    blocks = [s.unflatten(dim, (segments, s.shape[dim] // segments)) for s in shards]
    return torch.stack(blocks, dim + 1).flatten(dim, dim + 2)


class TensorParallelShards:
    """One model's TP shards: a leaf Parameter per TP-sharded parameter, cut at the first graph that reads it and
    taken by every later one (a recompile trains the same shards). The whole parameter's storage is then
    released: it keeps its shape for Dynamo's guards, and the compiled graphs are handed the shard in its place."""

    def __init__(self, tp: int, rank: int, group):
        self.tp, self.rank, self.group = tp, rank, group  # group: the TP process group
        self._by_param: dict[int, tuple] = {}  # id(whole Parameter) -> (whole, partition, shard)
        self._by_shard: dict[int, object] = {}  # id(shard) -> its partition

    def shard(self, whole: torch.nn.Parameter, partition, name: str) -> torch.nn.Parameter:
        held = self._by_param.get(id(whole))
        if held is not None:
            if held[1] != partition:
                raise ValueError(f"gradsched tp={self.tp}: a later graph splits parameter {name} as {partition}, the "
                                 f"first as {held[1]}; its shard cannot be both. Compile the model as one graph "
                                 "(fullgraph=True), or use it the same way in every graph.")
            return held[2]
        if whole.untyped_storage().nbytes() == 0 and whole.numel():
            raise RuntimeError(f"gradsched tp={self.tp}: parameter {name} has no storage left to cut its shard from.")
        shard = torch.nn.Parameter(local_shard(whole, partition, self.tp, self.rank), requires_grad=whole.requires_grad)
        self._by_param[id(whole)] = (whole, partition, shard)
        self._by_shard[id(shard)] = partition
        with torch.no_grad():
            whole.untyped_storage().resize_(0)
        mark_superseded([whole], f"its tensor-parallel shard {tuple(shard.shape)}")
        return shard

    def of(self, whole) -> torch.nn.Parameter | None:
        """The shard standing for `whole` (None: replicated, or not yet read by any graph)."""
        held = self._by_param.get(id(whole))
        return held[2] if held is not None else None

    def partition_of(self, whole):
        held = self._by_param.get(id(whole))
        return held[1] if held is not None else None

    def partition_of_shard(self, shard):
        """The partition a trained shard was cut by (None: `shard` is no TP shard, e.g. a replicated parameter)."""
        return self._by_shard.get(id(shard))

    @torch.no_grad()
    def gather(self, whole, value: torch.Tensor) -> torch.Tensor:
        """`value` (this rank's shard of `whole`, e.g. its trained values) gathered whole over the TP group; every
        TP rank calls it for the same parameters in the same order."""
        partition = self._by_param[id(whole)][1]
        parts = [torch.empty_like(value) for _ in range(self.tp)]
        dist.all_gather(parts, value.contiguous(), group=self.group)
        return whole_from_shards(parts, partition)
