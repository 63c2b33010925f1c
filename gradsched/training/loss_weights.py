"""The loss of the global batch, from each rank's share of it.

A rank sees only its share of the batch (dp), of each sequence (cp) and of each micro-batch.
Averaging the ranks' own means is wrong as soon as they hold different numbers of labelled tokens
(ignore_index, padding). With average=True, each micro-batch's mean loss is weighted by its
labelled tokens over the global batch's, times the gradient group size (the reduction divides by
it): the step's gradient is exactly that of the mean over all labelled tokens of the global batch,
as in one process. With average=False, loss_fn is taken as a sum and summed, over micro-batches
and ranks alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gradsched.plan import ParallelPlan
from gradsched.sync.watchdog import JOURNAL


def labelled(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The number of scored elements of `target`, as a float64 tensor (no device sync)."""
    if target.dtype.is_floating_point:  # a regression target: every element is scored
        return torch.tensor(float(target.numel()), dtype=torch.float64, device=target.device)
    return (target != ignore_index).sum().to(torch.float64)


def global_count(targets: torch.Tensor, plan: ParallelPlan, ignore_index: int) -> torch.Tensor:
    """Labelled tokens of the global batch: this rank's, summed over the last stage's gradient group."""
    total = labelled(targets, ignore_index)
    if len(plan.group_ranks("grad")) > 1:  # the last stage's gradient group holds the global batch
        pg = plan.process_group("grad")
        with JOURNAL.entry("the global batch's labelled-token count", "collective", pg, "all_reduce", 1, total.dtype):
            dist.all_reduce(total, group=pg)
    if total == 0:
        raise ValueError(f"every target of this step is ignore_index={ignore_index}: the mean loss "
                         "is undefined. Check the labels (or ignore_index=).")
    return total


def weighted(loss_fn, out, target, total: torch.Tensor, plan: ParallelPlan, ignore_index: int, observe):
    """A micro-batch's share of the step's loss (`observe(loss)` sees its unweighted loss)."""
    n = labelled(target, ignore_index)
    if n == 0:  # all ignored: the mean would be 0/0; contribute exact zeros instead
        return sum(t.sum() * 0.0 for t in torch.utils._pytree.tree_leaves(out) if t.is_floating_point())
    weight = n * len(plan.group_ranks("grad")) / total  # a tensor: no device sync
    loss = loss_fn(out, target)
    observe(loss)
    return loss * weight.to(loss.dtype)


def global_loss(losses: list, plan: ParallelPlan, average: bool) -> torch.Tensor:
    """The step's loss over the global batch (mean over labelled tokens, or sum), from this rank's
    micro-batch losses: the same on every rank of the last stage."""
    loss = torch.stack([x.detach() for x in losses]).sum().to(torch.float64)
    group_size = len(plan.group_ranks("grad"))
    if average:
        loss = loss / group_size
    if group_size > 1:
        pg = plan.process_group("grad")
        with JOURNAL.entry("the step's loss over the global batch", "collective", pg, "all_reduce", 1, loss.dtype):
            dist.all_reduce(loss, group=pg)
    return loss.float()
