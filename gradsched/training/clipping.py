"""Gradient clipping by the global norm, as one process would compute it.

After a step's sync, a rank holds its shard of every bucket (shard=True) or every
reduced gradient whole (shard=False). The global norm counts every gradient once:
  - shards: each rank sums the squares of what its shards hold (padding is zero), and the
    sum over all ranks of the plan covers each stage's gradients once;
  - whole gradients: only the first rank of each gradient group counts its stage's;
  - a tied weight has a copy, holding the summed gradient, on every stage of its tie: only
    the tie's first stage counts it;
  - under tp > 1 a TP rank's shards are its own, but a parameter whole on every TP rank (a norm's
    weight) has its summed gradient on each: only the TP group's first rank counts it.
The norm is then scaled into the reduced gradients in place, the same factor on every rank,
so tied copies stay equal. Call it after `train_step` (the flush included), before the
optimizer's step.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gradsched.sync.nonfinite import agree
from gradsched.training.model_state import find_sync
from gradsched.training.shards import owned_pieces


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
    """Scale this step's reduced gradients so their global norm is at most max_norm; return the
    norm before clipping (equal on every rank; float32, float64 for a float64 model), as
    torch.nn.utils.clip_grad_norm_."""
    sync = find_sync(model)
    if sync is None or sync.sync_plan is None:
        raise RuntimeError("clip_grad_norm_ before the model's first step: run train_step (or a forward and "
                           "backward) first, then clip, then step the optimizer.")
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type}: gradsched clips by the 2-norm or the inf-norm.")
    plan, setup = sync.sync_plan, sync.setup
    counted = {n for n in sync.params if n not in setup.ties or min(setup.ties[n].stages) == setup.stage}
    if setup.tp_group is not None and setup.tp_group.index:  # a parameter whole on every TP rank: counted on the first
        counted &= set(sync.built.tp_sharded)
    grads = _this_steps_gradients(sync, plan, counted)
    device = next(iter(sync.params.values())).device
    if norm_type == 2.0:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            local += g.double().pow(2).sum()
        op = dist.ReduceOp.SUM
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            local = torch.maximum(local, g.double().abs().max()) if g.numel() else local
        op = dist.ReduceOp.MAX
    # the norm alone after a train_step (its end agreed the flags); else (the backend by name) one collective for
    # the norm and the step's non-finite flags: a non-finite gradient makes this rank's partial norm non-finite,
    # so it needs no pass of its own (gradsched.sync.nonfinite)
    local = agree(sync, local, op, "clip_grad_norm_'s global norm and the step's non-finite flags",
                  grads_marker=local)
    total = (local.sqrt() if norm_type == 2.0 else local).to(_norm_dtype(sync.params.values()))
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    for g in sync.gradients():
        g.mul_(coef.to(g.dtype))
    return total


def _norm_dtype(params) -> torch.dtype:
    return torch.float64 if all(p.dtype == torch.float64 for p in params) else torch.float32


def _this_steps_gradients(sync, plan, counted: set) -> list[torch.Tensor]:
    """The tensors whose squares this rank adds to the global norm."""
    reduced = sync.reduced()  # shards, or whole buckets with shard=False
    if len(reduced) != len(plan.layout.buckets):
        raise RuntimeError("clip_grad_norm_ before this step's gradients were reduced: call it after "
                           "train_step (under pp > 1 the flush reduces the tied buckets at its end), before "
                           "the optimizer's step.")
    if plan.shard:
        return [reduced[pc.bucket][pc.at:pc.at + pc.numel]
                for pc in owned_pieces(plan.layout, plan.grad_group.index) if pc.name in counted]
    if plan.grad_group.index != 0:  # every rank of the group holds the same reduced gradients
        return []
    return [sync.params[n].grad for n in sorted(counted) if sync.params[n].grad is not None]
