"""The distributed optimizer: each data-parallel rank steps any torch.optim optimizer over its shards.

The sync graph leaves, per bucket, this rank's reduced gradient shard. The
optimizer holds an fp32 master copy of the matching parameter shard, steps it
with the wrapped torch.optim optimizer (elementwise optimizers such as AdamW
give exactly what they give unsharded), then all-gathers the buckets and
writes the parameters back. Tied copies receive identical gradients, so they
stay equal.

With shard=False (plain data parallel) the reduced gradients are already in
.grad and the optimizer is an ordinary one over the full parameters.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

_SHARDED = weakref.WeakValueDictionary()  # id -> parameter whose gradient only exists as shards


def mark_sharded(params) -> None:
    for p in params:
        _SHARDED[id(p)] = p


def is_sharded(p) -> bool:
    return _SHARDED.get(id(p)) is p  # by identity: tensors' == is elementwise


def _refuse_full_parameter_step(optimizer, args, kwargs):
    if any(is_sharded(p) for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() over full parameters that gradsched reduces into shards: their "
            ".grad is empty and the step would do nothing. Use gradsched.DistributedOptimizer(model, "
            f"torch.optim.{type(optimizer).__name__}, ...) instead, or shard=False for plain data parallel.")


register_optimizer_step_pre_hook(_refuse_full_parameter_step)


def _all_gather(out, x, group):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


class DistributedOptimizer:
    def __init__(self, model, optimizer_class, **optimizer_kwargs):
        if isinstance(optimizer_class, torch.optim.Optimizer):
            n = sum(len(g["params"]) for g in optimizer_class.param_groups)
            raise TypeError(
                f"DistributedOptimizer got an already built {type(optimizer_class).__name__} over {n} full "
                "parameter tensors; a distributed optimizer steps only this rank's shards, which exist after "
                "the first backward. Pass the class and its arguments: "
                f"DistributedOptimizer(model, torch.optim.{type(optimizer_class).__name__}, lr=...).")
        self.model = model
        self.optimizer_class, self.kwargs = optimizer_class, optimizer_kwargs
        self.optimizer = None
        self.shards: list[torch.nn.Parameter] = []

    @property
    def sync(self):
        """The GradSync reducing the model's gradients: a ParallelModel's (built at its first step), or,
        for torch.compile(model, backend="gradsched"), the one the backend attached to its parameters."""
        from .runtime import sync_of
        sync = getattr(self.model, "grad_sync", None)
        if sync is None and not hasattr(self.model, "grad_sync"):
            sync = sync_of(self.model.parameters())
        if sync is None or sync.sync_plan is None:
            raise RuntimeError("DistributedOptimizer.step() before the model's first forward and backward: the "
                               "gradient shards are laid out by the first backward graph.")
        return sync

    def _build(self):
        sync = self.sync
        plan, params = sync.sync_plan, sync.params
        if not plan.shard:
            self.optimizer = self.optimizer_class(list(params.values()), **self.kwargs)
            return
        shards, me = len(plan.grad_group.ranks), plan.grad_group.index
        for b in plan.layout.buckets:
            flat = self._flat_params(b, params)
            size = b.shard_numel(shards)
            self.shards.append(torch.nn.Parameter(flat[me * size:(me + 1) * size].float().clone()))
        self.optimizer = self.optimizer_class(self.shards, **self.kwargs)

    @staticmethod
    def _flat_params(b, params) -> torch.Tensor:
        device = params[b.slots[0].name].device
        flat = torch.zeros(b.numel, dtype=torch.float32, device=device)
        for s in b.slots:
            flat[s.offset:s.offset + s.numel] = params[s.name].detach().reshape(-1).float()
        return flat

    @torch.no_grad()
    def step(self):
        if self.optimizer is None:
            self._build()
        sync = self.sync
        plan = sync.sync_plan
        if not plan.shard:
            self.optimizer.step()
            return
        reduced = sync.results
        if len(reduced) != len(self.shards):
            raise RuntimeError("DistributedOptimizer.step() before this step's gradients were reduced: run the "
                               "step's backward passes (and flush() under pipeline parallelism) first.")
        for shard, g in zip(self.shards, reduced):
            shard.grad = g.float()
        self.optimizer.step()
        pg = sync.grad_group()[0]
        params = sync.params
        for b, shard, dtype in zip(plan.layout.buckets, self.shards, plan.gather_dtypes):
            # gathered in the plan's dtype (the parameters' own: bf16 is half the bytes of fp32);
            # the fp32 master shard stays here
            full = torch.empty(b.numel, dtype=dtype, device=shard.device)
            _all_gather(full, shard.detach().to(dtype), pg)
            for s in b.slots:
                p = params[s.name]
                p.copy_(full[s.offset:s.offset + s.numel].view(p.shape).to(p.dtype))
        sync.clear_results()

    def zero_grad(self, set_to_none: bool = True):
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)
        for p in self.model.parameters():
            p.grad = None

    def state_dict(self):
        return self.optimizer.state_dict() if self.optimizer else {}
