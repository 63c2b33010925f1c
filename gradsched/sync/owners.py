"""Which GradSync reduces a parameter's gradient, found from the parameter; a torch optimizer refused over
parameters whose gradient exists only as a GradSync's shards, or that the model no longer trains (built before
allocation or tensor-parallel sharding); and one over parameters reduced whole (shard=False) held to the step's
non-finite verdict, as DistributedOptimizer is."""
from __future__ import annotations

import bisect
import warnings
import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook


# A GradSync with shard=True leaves no .grad on its parameters: an ordinary torch.optim optimizer
# over them would step nothing. The first GradSync that shards installs a step pre-hook that says so.
_SHARDED = weakref.WeakValueDictionary()  # id -> parameter
# A Parameter the model no longer trains, another tensor trained in its place: a meta one once allocated, a whole
# one once its tensor-parallel shard is cut. An optimizer built before (over model.parameters()) holds it, and
# would silently step nothing: the same hook refuses it.
_SUPERSEDED = weakref.WeakValueDictionary()  # id -> parameter
_HOOK = []


def mark_sharded(params) -> None:
    for p in params:
        _SHARDED[id(p)] = p
    _install_refusal()


def mark_superseded(params, by: str) -> None:
    """`by`: what the model trains in these parameters' place, for the refusal's message."""
    for p in params:
        _SUPERSEDED[id(p)] = p
        p._gradsched_superseded_by = by
    _install_refusal()


def _install_refusal() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_untrained_step))


def is_sharded(p) -> bool:
    return _SHARDED.get(id(p)) is p  # by identity: tensors' == is elementwise


def _refuse_untrained_step(optimizer, args, kwargs):
    name = type(optimizer).__name__
    params = [p for g in optimizer.param_groups for p in g["params"]]
    old = [p for p in params if _SUPERSEDED.get(id(p)) is p]
    if old:
        instead = old[0]._gradsched_superseded_by
        raise RuntimeError(
            f"{name}.step() over {len(old)} parameter(s) the model no longer trains ({instead} trains in the place "
            f"of a {tuple(old[0].shape)} one): the optimizer was built over model.parameters() before "
            "gradsched built the model, and would step nothing there. Build it after the first train_step (or "
            f"model.allocate(inputs, targets)), or use gradsched.DistributedOptimizer(model, torch.optim.{name}, ...).")
    if any(is_sharded(p) for p in params):
        raise RuntimeError(
            f"{name}.step() over full parameters that gradsched reduces into shards: their "
            ".grad is empty and the step would do nothing. Use gradsched.DistributedOptimizer(model, "
            f"torch.optim.{name}, ...) instead, or shard=False for plain data parallel.")


def attach(sync, params) -> None:
    """Remember which GradSync reduces these parameters (the optimizer finds it from them). Under shard=False a
    plain torch optimizer may step them: it is held to the step's non-finite verdict first."""
    for p in params:
        p._gradsched_sync = sync
    if not sync.options.shard and not _VERDICT_HOOK:
        _VERDICT_HOOK.append(register_optimizer_step_pre_hook(_verdict_first))


_VERDICT_HOOK = []


def _verdict_first(optimizer, args, kwargs):
    """A torch optimizer's step over parameters a GradSync reduces whole: the step's non-finite verdict first (one
    host read per GradSync and reduction, the same answer on every rank), as DistributedOptimizer.step asks it. A
    bad step raises NonFiniteError, or under on_nonfinite="skip" loses every gradient: torch's optimizers skip a
    parameter without one, so the step applies nothing (weight decay and the step counts included). Without this,
    a NaN gradient was applied (docs/faults.md: never). Not asked: DistributedOptimizer's own optimizer (it asked),
    a step under AMP's GradScaler (it owns an overflow: a fused step skips it on the device) and a step with a
    closure (LBFGS: its gradients come after this hook)."""
    if getattr(optimizer, "_gradsched_asked", False) or kwargs.get("grad_scaler") is not None or \
            getattr(optimizer, "found_inf", None) is not None or kwargs.get("closure") is not None or \
            len(args) > 1 and args[1] is not None:  # args: (optimizer, closure)
        return
    syncs = {}  # each GradSync once, in the order its parameters come (the same on every rank)
    for g in optimizer.param_groups:
        for p in g["params"]:
            sync = getattr(p, "_gradsched_sync", None)
            if sync is not None and not sync.options.shard:  # sharded: refused by _refuse_full_parameter_step
                syncs.setdefault(id(sync), sync)
    applied = all([_verdict(sync) for sync in syncs.values()])  # every one asked (a list, not a short circuit)
    if not applied:
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None


_VERDICTS = weakref.WeakKeyDictionary()  # GradSync -> (its sync_runs when asked, the verdict)


def _verdict(sync) -> bool:
    """`sync`'s verdict on its latest reduction, asked once: several optimizers over one model (an embedding's and
    the rest's) share it, with no second collective, which ranks stepping other optimizers would not join. A skip
    drops every gradient of the model, as DistributedOptimizer.step does; a raise leaves the step refused for
    any later optimizer too."""
    from gradsched.sync import nonfinite  # imports the sync package's runtime pieces: here, not at import
    known = _VERDICTS.get(sync)
    if known is not None and known[0] == sync.sync_runs:
        return known[1]
    _VERDICTS[sync] = (sync.sync_runs, False)
    applied = nonfinite.check(sync, sync.options.on_nonfinite)
    _VERDICTS[sync] = (sync.sync_runs, applied)
    if not applied:
        sync.clear_results()
        for p in sync.params.values():
            p.grad = None
        sync.skipped_steps += 1  # said: a plain optimizer's step returns nothing to tell it by
        warnings.warn(f"gradsched: a step's gradients went non-finite and were dropped (on_nonfinite='skip'); "
                      f"{sync.skipped_steps} step(s) skipped so far (model.skipped_steps).", RuntimeWarning, stacklevel=2)
    return applied


def sync_of(params) -> "GradSync | None":  # gradsched.sync.runtime's
    """The GradSync that reduces these parameters' gradients, if a gradsched backend compiled them."""
    found = {id(s): s for s in (getattr(p, "_gradsched_sync", None) for p in params) if s is not None}
    if len(found) > 1:
        raise RuntimeError("gradsched: these parameters are reduced by several compiled models; build one "
                           "DistributedOptimizer per compiled model.")
    return next(iter(found.values()), None)


def all_inside(grads: list, buckets: list) -> bool:
    """Every element of every tensor of `grads` lies in the memory of one of `buckets`, of its dtype and device:
    scaling the buckets scales them. By address alone: two live storages never share an address range on one device,
    so a range inside a bucket's is of its storage (a few calls a tensor: this runs every step, shard=False)."""
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), b.dtype, b.device) for b in buckets)
    starts = [s[0] for s in spans]
    for g in grads:
        ptr = g.data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0 or not g.is_contiguous():
            return False
        start, end, dtype, device = spans[i]
        if g.dtype != dtype or g.device != device or ptr + g.numel() * g.element_size() > end:
            return False
    return True
