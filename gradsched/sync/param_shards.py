"""shard="params": where a stage's parameters live, as this rank's shard of each bucket.

Laid out when the stage's forward graph is compiled (the backward graph, which lays out the other
modes' buckets, is compiled only at the first backward, and the forward must already gather):
gradients are expected ready in the reverse order of the parameters' first use in the forward,
and `plan_layout` buckets them as it would the backward's ready order. The backward's reductions
then use this same layout (`plan_sync(layout=...)`).

Several stages a rank (a V, looped schedules): each stage graph's forward lays out, when it compiles, the
parameters no earlier one did, as buckets appended to the rank's layout (`shard_more`): no bucket spans two
stage graphs, so a stage gathers its own; a tie merged on the rank lives where its first reader laid it out,
and its other reader gathers that bucket too. Every rank of the gradient group holds the same stages and
compiles them in the schedule's order, so the layouts agree (the agreement checks the graphs' collectives).

Each bucket's shard is a flat tensor in the bucket's gather dtype (the parameters' own), holding
the elements `owned_range` gives this rank, zeros in the padding. Once the shards are filled, the
parameters' storage is released (`untyped_storage().resize_(0)`): they keep their shape, dtype
and device, which is all the compiled graphs' guards read, and every graph reads the shards.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from gradsched.options import SyncOptions
from gradsched.passes.bucketing import BucketLayout, owned_range
from gradsched.passes.param_gather import GatherSpec, ParamSlot, expected_ready_order
from gradsched.sync.sync_plan import gather_dtype, plan_layout
from gradsched.sync.watchdog import JOURNAL


def all_gather(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """Eager all-gather of `x` from every rank of `group` into `out`, by torch's current name for it
    (all_gather_into_tensor is deprecated in favour of all_gather_single); its Work with async_op=True."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, x, group=group, async_op=async_op)


@dataclass
class ParamShards:
    layout: BucketLayout
    index: int  # this rank's position in the gradient group
    dtypes: tuple  # per bucket: the shard's dtype
    shards: dict  # bucket index -> this rank's shard (a flat tensor)
    params: dict  # parameter name -> the Parameter (its storage released once the first graph is compiled)

    def spec(self, group: str, names: dict, keep_placeholders_in_output: bool) -> GatherSpec:
        """The gather pass's spec for a graph whose placeholders `names` (placeholder -> parameter name)
        hold these parameters."""
        slots = {}
        for ph, name in names.items():
            b, s = self.layout.locate(name)
            slots[ph] = ParamSlot(b.index, s.offset, s.numel, tuple(s.shape), self.params[name].dtype)
        return GatherSpec(slots, {b.index: b.shard_numel(self.layout.shards) for b in self.layout.buckets},
                          {b.index: d for b, d in zip(self.layout.buckets, self.dtypes)}, group,
                          self.layout.shards, keep_placeholders_in_output)

    def inputs(self, buckets) -> list[torch.Tensor]:
        return [self.shards[k] for k in buckets]

    @torch.no_grad()
    def gathered(self, pg) -> dict[str, torch.Tensor]:
        """Every parameter whole, as a new tensor (parameter name -> value): one all-gather per bucket over
        the gradient group `pg`, which every rank of it must call. The parameters themselves stay released:
        reading them would read memory they no longer own."""
        out = {}
        for b, dtype in zip(self.layout.buckets, self.dtypes):
            shard = self.shards[b.index]
            full = torch.empty(b.numel, dtype=dtype, device=shard.device)
            with JOURNAL.entry(f"shard='params': all-gather of bucket {b.index}'s parameters, to read them whole",
                               "collective", pg, "all_gather", b.numel, dtype):
                all_gather(full, shard, pg)
            for s in b.slots:
                out[s.name] = full[s.offset:s.offset + s.numel].view(s.shape).to(self.params[s.name].dtype).clone()
        return out

    @torch.no_grad()
    def set_whole(self, name: str, value: torch.Tensor) -> None:
        """Parameter `name` takes `value` (whole): this rank's shard keeps its owned elements (a checkpoint's load)."""
        b, s = self.layout.locate(name)
        lo, hi = owned_range(b.numel, s.offset, s.numel, self.layout.shards, self.index)
        if lo < hi:
            at = s.offset + lo - self.index * b.shard_numel(self.layout.shards)
            self.write(b.index, at, value.reshape(-1)[lo:hi])

    def write(self, bucket: int, at: int, values: torch.Tensor) -> None:
        """Elements [at, at + len) of this rank's shard of `bucket` (the optimizer's update)."""
        shard = self.shards[bucket]
        shard[at:at + values.numel()] = values.to(shard.dtype)


    def forget_after(self, buckets: int) -> None:
        """Back to the first `buckets` buckets: a stage graph's compile that failed leaves no buckets of its own
        (their parameters keep their storage: nothing was released)."""
        dropped = self.layout.buckets[buckets:]
        self.layout = BucketLayout(self.layout.buckets[:buckets], self.layout.shards)
        self.dtypes = self.dtypes[:buckets]
        for b in dropped:
            self.shards.pop(b.index, None)
            for s in b.slots:
                self.params.pop(s.name, None)

    def release(self) -> None:
        """The parameters' own storage goes: from now on only the shards hold them (once the first graph
        reading them is compiled: a failed compile leaves the model whole)."""
        with unset_fake_temporarily():  # called while AOTAutograd traces: these are the real parameters
            for p in self.params.values():
                p.untyped_storage().resize_(0)


def shard_parameters(fw_gm: fx.GraphModule, names: dict, params: dict, options: SyncOptions, index: int,
                     shards: int, ties: dict) -> ParamShards:
    """Lay out the parameters the forward graph reads (`names`: placeholder -> parameter name) and copy this
    rank's shard of each bucket out of them (`release` then frees theirs)."""
    ready = expected_ready_order(fw_gm, {ph: (n, tuple(params[n].shape), params[n].dtype) for ph, n in names.items()})
    layout = plan_layout(ready, options, shards, ties)
    with unset_fake_temporarily(), torch.no_grad():  # called while AOTAutograd traces: these tensors are real
        return _fill(layout, names, params, shards, index)


def shard_more(shards: ParamShards, fw_gm: fx.GraphModule, names: dict, params: dict, options: SyncOptions,
               ties: dict) -> None:
    """Several stages a rank: the parameters this stage graph's forward reads and no earlier one laid out join
    `shards` (in place: the graphs compiled before read the same object) as buckets of their own, appended
    (indices continuing); the earlier buckets unchanged."""
    laid_out = {s.name for b in shards.layout.buckets for s in b.slots}
    new = {ph: n for ph, n in names.items() if n not in laid_out}
    if not new:
        return
    more = shard_parameters(fw_gm, new, params, options, shards.index, shards.layout.shards, ties)
    at = len(shards.layout.buckets)
    moved = tuple(dataclasses.replace(b, index=at + b.index) for b in more.layout.buckets)
    shards.layout = BucketLayout(shards.layout.buckets + moved, shards.layout.shards)
    shards.dtypes += more.dtypes
    shards.shards.update({at + k: v for k, v in more.shards.items()})
    shards.params.update(more.params)


def _fill(layout: BucketLayout, names: dict, params: dict, shards: int, index: int) -> ParamShards:
    dtypes = tuple(gather_dtype(params[s.name].dtype for s in b.slots) for b in layout.buckets)
    out = {}
    for b, dtype in zip(layout.buckets, dtypes):
        size = b.shard_numel(shards)
        device = params[b.slots[0].name].device
        mine = torch.zeros(size, dtype=dtype, device=device)
        for s in b.slots:
            lo, hi = owned_range(b.numel, s.offset, s.numel, shards, index)
            if lo < hi:
                at = s.offset + lo - index * size
                mine[at:at + hi - lo] = params[s.name].detach().reshape(-1)[lo:hi].to(dtype)
        out[b.index] = mine
    return ParamShards(layout, index, dtypes, out, {s.name: params[s.name] for b in layout.buckets for s in b.slots})
