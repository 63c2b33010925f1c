"""Which GradSync reduces a parameter's gradient, found from the parameter; and a torch optimizer refused over
parameters whose gradient exists only as a GradSync's shards."""
from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook


# A GradSync with shard=True leaves no .grad on its parameters: an ordinary torch.optim optimizer
# over them would step nothing. The first GradSync that shards installs a step pre-hook that says so.
_SHARDED = weakref.WeakValueDictionary()  # id -> parameter
_HOOK = []


def mark_sharded(params) -> None:
    for p in params:
        _SHARDED[id(p)] = p
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_full_parameter_step))


def is_sharded(p) -> bool:
    return _SHARDED.get(id(p)) is p  # by identity: tensors' == is elementwise


def _refuse_full_parameter_step(optimizer, args, kwargs):
    if any(is_sharded(p) for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() over full parameters that gradsched reduces into shards: their "
            ".grad is empty and the step would do nothing. Use gradsched.DistributedOptimizer(model, "
            f"torch.optim.{type(optimizer).__name__}, ...) instead, or shard=False for plain data parallel.")


def attach(sync, params) -> None:
    """Remember which GradSync reduces these parameters (the optimizer finds it from them)."""
    for p in params:
        p._gradsched_sync = sync


def find_sync(model) -> "GradSync | None":  # gradsched.sync.runtime's
    """The GradSync of a gradsched.parallelize model (None before its first step), or of a model
    compiled with backend="gradsched", found from its parameters."""
    if hasattr(model, "grad_sync"):
        return model.grad_sync
    return sync_of(model.parameters())


def sync_of(params) -> "GradSync | None":  # gradsched.sync.runtime's
    """The GradSync that reduces these parameters' gradients, if a gradsched backend compiled them."""
    found = {id(s): s for s in (getattr(p, "_gradsched_sync", None) for p in params) if s is not None}
    if len(found) > 1:
        raise RuntimeError("gradsched: these parameters are reduced by several compiled models; build one "
                           "DistributedOptimizer per compiled model.")
    return next(iter(found.values()), None)


def lies_inside(g: torch.Tensor, bucket: torch.Tensor) -> bool:
    """Every element of `g` lies in `bucket`'s memory, of the same dtype: scaling the bucket scales `g`."""
    if g.dtype != bucket.dtype or g.untyped_storage().data_ptr() != bucket.untyped_storage().data_ptr():
        return False
    start, end = bucket.data_ptr(), bucket.data_ptr() + bucket.numel() * bucket.element_size()
    return g.is_contiguous() and start <= g.data_ptr() and g.data_ptr() + g.numel() * g.element_size() <= end
