"""SyncPlan: one stage's gradient collectives, as plain data.

Built once per stage, from the backward graph's ready order and the options
(`plan_sync`), and then handed explicitly to whatever needs it: the grad-sync
pass gets its SyncSpec from it, the report prints it, the optimizer reads its
layout and gather dtypes, and its fingerprint names it in messages. Nothing
here touches a graph or a process group; groups are named by their
process-group names and rank lists, as the collectives address them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from gradsched.passes import SyncSpec, place_buckets, plan_buckets
from gradsched.passes.bucketing import BucketLayout
from gradsched.passes.grad_ready_order import GradSpec

from gradsched.options import SyncOptions


@dataclass(frozen=True)
class Group:
    name: str  # the process group's name, as the collectives take it
    ranks: tuple[int, ...]
    index: int  # this rank's position in `ranks`


@dataclass(frozen=True)
class SyncPlan:
    stage: int
    rank: int
    ready: tuple[GradSpec, ...]  # gradients in the order the backward produces them
    layout: BucketLayout  # every bucket of the stage
    graphs: dict  # "backward" | "flush" | "early{j}" (several stages a rank) -> the sub-layout that graph reduces
    grad_group: Group
    tie_groups: dict  # tie key -> Group
    ties: dict  # parameter name -> tie key (this stage's tied copies)
    placement: str  # resolved: "tied_at_flush" | "backward" | "flush"
    mode: str
    shard: bool | str  # the option: False (all-reduce), True (reduce-scatter), "params" (the parameters too)
    average: bool
    gather_dtypes: tuple[torch.dtype, ...]  # per bucket: the dtype its parameters are all-gathered in
    # sharded, over every rank of the plan, no fp16 bucket: a non-finite local gradient spreads over its bucket
    # before the reduction (passes/grad_sync.py), so each rank's own shards flag any rank's (nonfinite.reduced_alike)
    spread_nonfinite: bool = False

    @property
    def params_sharded(self) -> bool:
        """shard="params": the parameters live as shards of their buckets."""
        return self.shard == "params"

    def spec(self, where: str, grad_outputs: dict[str, int], accumulate: bool) -> SyncSpec:
        """The grad-sync pass's input for graph `where` (an early graph's reductions are waited for outside it,
        so none waits for the one before)."""
        return SyncSpec(layout=self.graphs[where], grad_outputs=grad_outputs, group=self.grad_group.name,
                        group_size=len(self.grad_group.ranks), shard_rank=self.grad_group.index,
                        tie_groups={k: g.name for k, g in self.tie_groups.items()}, mode=self.mode,
                        shard=bool(self.shard), average=self.average, accumulate=accumulate,
                        chain=not where.startswith("early"), spread_nonfinite=self.spread_nonfinite)

    def names(self, where: str) -> set[str]:
        return {s.name for b in self.graphs[where].buckets for s in b.slots}

    def inputs(self, where: str = "flush") -> list[GradSpec]:
        """A graph's inputs, where it takes the gradients (the flush, an early graph): those it reduces, in
        ready order."""
        names = self.names(where)
        return [r for r in self.ready if r.name in names]

    def to_json(self) -> dict:
        return {"stage": self.stage, "placement": self.placement, "mode": self.mode, "shard": self.shard,
                "average": self.average, "grad_group": list(self.grad_group.ranks),
                "tie_groups": {k: list(g.ranks) for k, g in sorted(self.tie_groups.items())},
                "buckets": self.layout.describe(),
                "graphs": {w: [b.index for b in part.buckets] for w, part in sorted(self.graphs.items())},
                "gather_dtypes": [str(d) for d in self.gather_dtypes],
                "spread_nonfinite": self.spread_nonfinite}

    def fingerprint(self) -> str:
        """Short hash of the plan: equal on two ranks exactly when they plan the same collectives."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:12]


def gather_dtype(dtypes) -> torch.dtype:
    """The dtype a bucket's parameters are all-gathered in: theirs when they share one (bf16
    parameters: half the bytes of fp32), else fp32."""
    dtypes = set(dtypes)
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def plan_sync(ready: list[GradSpec], options: SyncOptions, *, stage: int, rank: int, placement: str,
              grad_group: Group, tie_groups: dict[str, Group], ties: dict[str, str],
              param_dtypes: dict[str, torch.dtype], layout: BucketLayout | None = None,
              every_rank: bool = False) -> SyncPlan:
    """The stage's plan: buckets in ready order (tied gradients alone, except in unsafe_rs_first,
    where #844's layout is the point), and which graph reduces each. `layout`: the one the
    parameters already live in (shard="params": laid out at the forward's compile). `every_rank`: the gradient
    group is every rank of the plan (pp 1), where sharded buckets spread a non-finite element (`spread_nonfinite`):
    the step's one gather of flags then goes out before the last backward (gradsched.sync.nonfinite)."""
    layout = layout or plan_layout(ready, options, len(grad_group.ranks), ties)
    gather = tuple(gather_dtype(param_dtypes[s.name] for s in b.slots) for b in layout.buckets)
    # not with fp16 buckets: a sum of finite fp16 gradients overflows, on the shard holding it alone
    spread = bool(options.shard) and every_rank and all(b.dtype != torch.float16 for b in layout.buckets)
    return SyncPlan(stage, rank, tuple(ready), layout, place_buckets(layout, placement), grad_group,
                    dict(tie_groups), dict(ties), placement, options.mode, options.shard, options.average, gather,
                    spread)


def plan_layout(ready: list[GradSpec], options: SyncOptions, shards: int, ties: dict[str, str]) -> BucketLayout:
    return plan_buckets(ready, bucket_mb=options.bucket_mb, shards=shards, reduce_dtype=options.reduce_dtype, ties=ties,
                        # a bucket of its own for each tied gradient: shard_aligned needs it for
                        # correctness; tied_first for bitwise-equal copies (the reduce-scatter then
                        # sums every copy's elements in the same order)
                        align_ties=options.mode != "unsafe_rs_first")
