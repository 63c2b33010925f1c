"""The loss of the global batch, from each rank's share of it.

A rank sees only its share of the batch (dp), of each sequence (cp) and of each micro-batch.
Averaging the ranks' own means is wrong as soon as they hold different numbers of labelled tokens
(ignore_index, padding). With average=True the step's gradient is exactly that of the mean over all
labelled tokens of the global batch, as in one process, and nothing waits for a count before the
backward:
  - micro-batch i's mean loss is weighted by n_i * G / K: its labelled tokens n_i, the gradient group's
    size G (the reduction divides by it) and a scale K the same on every rank: the previous step's
    global count (the first step all-reduces its own, once);
  - the reduced gradients are then (N / K) times the global mean's, N this step's global count. N
    rides in the step's one reduction of the non-finite flags (gradsched.sync.nonfinite), each rank's
    count and loss share in its row, and the gradients are scaled by K / N on the device
    (`step_result`). With a steady count (no padding) K / N is exactly 1. Where the last stage's gradient
    group is one rank (dp = cp = 1), K is this step's own count (no collective): K / N is 1 and the
    gradients are not scaled at all (a pass over them saved, ~40 ms a step for 14M parameters on a CPU core).
With average=False, loss_fn is taken as a sum and summed, over micro-batches and ranks alike.
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
    gradient group: the first step's scale K (later steps take the previous step's count, reduced with the
    flags). Never read on the host."""
    total = counts.sum()
    if len(plan.group_ranks("grad")) > 1:  # the last stage's gradient group holds the global batch
        pg = plan.process_group("grad")
        # issued, not waited for: the first micro-batch's loss weight waits, its forward overlapping it
        with JOURNAL.entry("the global batch's labelled-token count", "collective", pg, "all_reduce", 1, total.dtype):
            total = funcol.all_reduce(total, "sum", pg)
    return total


class StepWeights:
    """Each micro-batch's (keep, weight) for `gated`, computed for the whole step at its first use (the first
    step's count waited for then): its labelled count over the scale `total` (K), times the gradient group's
    size (its reduction divides by it), in float64."""

    def __init__(self, counts: torch.Tensor, total: torch.Tensor, plan: ParallelPlan):
        self.counts, self.total, self.group = counts, total, len(plan.group_ranks("grad"))
        self.parts, self.scaled = None, False  # every micro-batch's (keep, weight)

    def scale(self) -> torch.Tensor:
        """K as a plain tensor, at least 1 (a first step without a label would otherwise weigh every later one by
        n / 0); any K the same on every rank gives the same gradients after `step_result`'s K / N."""
        if not self.scaled:
            self.total, self.scaled = settled(self.total).clamp(min=1.0), True
        return self.total

    def __call__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch i's (keep, weight), each of shape [1] (what a compiled graph takes: GlobalLoss.gate), the
        weight in float64 (cast to the loss's own dtype where it is applied): made for every micro-batch at once."""
        if self.parts is None:
            self.parts = list(zip((self.counts > 0).split(1), (self.counts * self.group / self.scale()).split(1)))
        return self.parts[i]


def settled(total: torch.Tensor) -> torch.Tensor:
    """`total` as a plain tensor, its all-reduce waited for (on the device's stream, not the host's, on a
    GPU). Once per step: every op on the collective's asynchronous result runs through its Python subclass
    (~0.1 ms of host time an op here)."""
    return total.wait() if isinstance(total, funcol.AsyncCollectiveTensor) else total


class _GradientUnless(torch.autograd.Function):
    """Identity forward; backward passes the gradient where `keep`, exact zeros elsewhere (a loss over no
    labelled element is 0/0, and so may its gradient be: NaN must not reach the model's gradients). A Function,
    not a hook on the output: a hook would stay on a leaf output reused across micro-batches (a received buffer
    returned as is), and change a 0-d output's gradient's shape."""

    @staticmethod
    def forward(ctx, t, keep):
        ctx.save_for_backward(keep)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return torch.where(keep, grad, 0.0).reshape(grad.shape), None


def weighted(loss_fn, out, target, total: torch.Tensor, plan: ParallelPlan, ignore_index: int):
    """A micro-batch's share of the step's loss, counted from its own targets (`StepWeights` counts a step's at
    once)."""
    return gated(loss_fn, out, target, *own_weights(target, total, plan, ignore_index))


def own_weights(target, total: torch.Tensor, plan: ParallelPlan, ignore_index: int):
    """(keep, weight) of a micro-batch counted from its own targets."""
    return StepWeights(labelled(target, ignore_index).reshape(1), total, plan)(0)


def gated(loss_fn, out, target, keep: torch.Tensor, weight: torch.Tensor, in_graph: bool = False):
    """loss_fn(out, target) times `weight` where `keep`, else exact zeros, forward and backward. Branch-free: a
    micro-batch whose targets are all ignore_index contributes exact zeros, decided on the device. Nothing here
    reads or checks values: the step observes its losses for non-finite values once, at its end (a weighted loss
    is non-finite exactly where its loss is and it has labelled tokens). keep, weight: 0-d or [1].

    in_graph (traced into a compiled graph): the gate is a `where` between the output and its detached self (the
    same value forward; backward the gradient where `keep`, exact zeros elsewhere, NaN included), which Inductor
    fuses; eagerly that `where` would copy the model's output, so the eager gate is an autograd Function."""
    def gate(t):
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            return t
        return torch.where(keep, t, t.detach()) if in_graph else _GradientUnless.apply(t, keep)
    gated_out = gate(out) if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_map(gate, out)
    loss = loss_fn(gated_out, target)  # 0/0 on an empty micro-batch: the where gives exact zero instead
    return torch.where(keep, loss * weight.to(loss.dtype), 0.0).reshape(loss.shape)


def step_share(losses: list, plan: ParallelPlan, average: bool) -> torch.Tensor:
    """This rank's share of the step's loss, from its (weighted) micro-batch losses, in float64: times K / N
    (`step_result`) and summed over the ranks, the mean over the global batch's labelled tokens (or the sum).
    Non-finite exactly when one of the losses is: the step's one check of its losses."""
    loss = torch.stack([x.detach() for x in losses]).sum().to(torch.float64)
    return loss / len(plan.group_ranks("grad")) if average else loss


def step_result(counts: torch.Tensor, shares: torch.Tensor, scales: torch.Tensor, average: bool):
    """(the step's loss, the factor its reduced gradients need or None) from every rank's labelled count, loss
    share and scale K after the step's reduction (rows of the ranks that compute no loss hold zeros). The loss is
    NaN when the global batch has no labelled token (the mean over nothing, as in one process)."""
    share = shares.sum()
    if not average:
        return share, None
    factor = scales.max() / counts.sum()  # K / N: inf when N = 0, and the loss 0 * inf = NaN
    return share * factor, factor


def next_scale(scale: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The next step's K: this step's global count, or K again when it had none."""
    n = counts.sum()
    return torch.where(n > 0, n, scale)
