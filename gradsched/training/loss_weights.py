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
import torch.distributed._functional_collectives as funcol

from gradsched.plan import ParallelPlan
from gradsched.sync.watchdog import JOURNAL


def labelled(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The number of scored elements of `target`, as a float64 tensor (no device sync)."""
    if target.dtype.is_floating_point:  # a regression target: every element is scored
        return torch.tensor(float(target.numel()), dtype=torch.float64, device=target.device)
    return (target != ignore_index).sum().to(torch.float64)


def micro_batch_counts(targets: torch.Tensor, m: int, ignore_index: int) -> torch.Tensor:
    """[m] float64: the scored elements of each of `targets.chunk(m)` (the step's micro-batches), in one pass
    over the step's targets (a count per micro-batch cost three ops each; no device sync)."""
    if targets.dtype.is_floating_point:  # a regression target: every element is scored
        return torch.full((m,), float(targets.numel() // m), dtype=torch.float64, device=targets.device)
    return (targets != ignore_index).reshape(m, -1).sum(1, dtype=torch.float64)


def global_count(counts: torch.Tensor, plan: ParallelPlan) -> torch.Tensor:
    """Labelled tokens of the global batch: this rank's (`counts`, per micro-batch), summed over the last stage's
    gradient group. Never read on the host: a global batch with none makes the step's loss NaN (as in one
    process), which the step's non-finite check reports."""
    total = counts.sum()
    if len(plan.group_ranks("grad")) > 1:  # the last stage's gradient group holds the global batch
        pg = plan.process_group("grad")
        # issued, not waited for: the first micro-batch's loss weight waits, its forward overlapping it
        with JOURNAL.entry("the global batch's labelled-token count", "collective", pg, "all_reduce", 1, total.dtype):
            total = funcol.all_reduce(total, "sum", pg)
    return total


class StepWeights:
    """Each micro-batch's (keep, weight) for `gated`, computed for the whole step at its first use (the global
    count waited for then): its labelled count's share of the global batch's `total`, times the gradient group's
    size (its reduction divides by it), in float64."""

    def __init__(self, counts: torch.Tensor, total: torch.Tensor, plan: ParallelPlan):
        self.counts, self.total, self.group = counts, total, len(plan.group_ranks("grad"))
        self.parts = None

    def __call__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.parts is None:
            self.total = settled(self.total)
            # n <= total: where keep, total > 0
            self.parts = list(zip((self.counts > 0).unbind(), (self.counts * self.group / self.total).unbind()))
        return self.parts[i]


def settled(total: torch.Tensor) -> torch.Tensor:
    """`total` as a plain tensor, its all-reduce waited for (on the device's stream, not the host's, on a
    GPU). Once per step: every op on the collective's asynchronous result runs through its Python subclass
    (~0.1 ms of host time an op here)."""
    return total.wait() if isinstance(total, funcol.AsyncCollectiveTensor) else total


class _GradientUnless(torch.autograd.Function):
    """Identity forward; backward passes the gradient where `keep`, exact zeros elsewhere (a loss over no
    labelled element is 0/0, and so may its gradient be: NaN must not reach the model's gradients)."""

    @staticmethod
    def forward(ctx, t, keep):
        ctx.save_for_backward(keep)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return torch.where(keep, grad, 0.0), None


def weighted(loss_fn, out, target, total: torch.Tensor, plan: ParallelPlan, ignore_index: int):
    """A micro-batch's share of the step's loss, counted from its own targets (`StepWeights` counts a step's at
    once)."""
    keep, weight = StepWeights(labelled(target, ignore_index).reshape(1), total, plan)(0)
    return gated(loss_fn, out, target, keep, weight)


def gated(loss_fn, out, target, keep: torch.Tensor, weight: torch.Tensor):
    """loss_fn(out, target) times `weight` where `keep`, else exact zeros, forward and backward. Branch-free: a
    micro-batch whose targets are all ignore_index contributes exact zeros, decided on the device. Nothing here
    reads or checks values: the step observes its losses for non-finite values once, at its end (a weighted loss
    is non-finite exactly where its loss is and it has labelled tokens)."""
    gate = lambda t: _GradientUnless.apply(t, keep) if isinstance(t, torch.Tensor) and t.requires_grad else t  # noqa
    gated_out = gate(out) if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_map(gate, out)
    loss = loss_fn(gated_out, target)  # 0/0 on an empty micro-batch: the where gives exact zero instead
    return torch.where(keep, loss * weight.to(loss.dtype), 0.0)


def step_share(losses: list, plan: ParallelPlan, average: bool, total: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the step's loss over the global batch (mean over labelled tokens, or sum), from
    its micro-batch losses, in float64. `total` (with average): the global batch's labelled tokens; none makes
    the share NaN, as the mean over nothing is in one process. So the share is non-finite exactly when one of
    the losses is, or there is no mean: the step's one check of its losses."""
    loss = torch.stack([x.detach() for x in losses]).sum().to(torch.float64)
    if average:
        loss = loss / len(plan.group_ranks("grad"))
    if total is not None:  # the global count, the same on every rank: a NaN here is a NaN in the sum
        loss = torch.where(total > 0, loss, torch.full_like(loss, float("nan")))
    return loss


def global_loss(share: torch.Tensor, plan: ParallelPlan):
    """The step's loss, the same on every rank of the last stage: the shares summed over the gradient group.
    Its all-reduce is issued here and not waited for (at pp = 1 the last micro-batch's backward runs
    meanwhile): returns a function that gives the loss, waiting for it."""
    if len(plan.group_ranks("grad")) > 1:
        pg = plan.process_group("grad")
        with JOURNAL.entry("the step's loss over the global batch", "collective", pg, "all_reduce", 1, share.dtype):
            share = funcol.all_reduce(share, "sum", pg)
    return lambda: settled(share).float()
