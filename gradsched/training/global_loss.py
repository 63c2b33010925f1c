"""GlobalLoss: one rank's part in the loss of the global batch, step by step (the arithmetic: loss_weights).

A step begins with the last stage's targets (`begin`: each micro-batch's labelled count and weight), weighs
each micro-batch's loss as the schedule computes it (`__call__`), and ends (`end`, on every rank) with the step's
one gather of every rank's non-finite flags, labelled count and loss share (gradsched.sync.nonfinite): the step's
loss, and the factor that turns the reduced gradients into the global mean's, come from its rows on the device.
"""
from __future__ import annotations

import types
import warnings

import torch

from gradsched.plan import ParallelPlan
from gradsched.sync import nonfinite
from gradsched.training import loss_weights

WHAT = "the step's non-finite flags, labelled tokens and loss"


class GlobalLoss:
    def __init__(self, loss_fn, plan: ParallelPlan, average: bool, ignore_index: int, compiler: str = "eager",
                 vocab_parallel=None):
        self.loss_fn, self.plan, self.average, self.ignore_index = loss_fn, plan, average, ignore_index
        # pp > 1 under tp: the loss of the last stage's logits split over the vocabulary, when its graph leaves
        # them so (gradsched.training.vocab_parallel_loss.VocabParallelLoss); inactive otherwise
        self.vocab_parallel = vocab_parallel
        # pp > 1: the last stage's weighted loss as one compiled graph (Inductor), or None: eagerly, op by op
        self._compiled = _compiled_gated(loss_fn) if compiler == "inductor" else None
        self.weights = None  # this step's micro-batch weights (loss_weights.StepWeights), on the last stage
        self.scale = None  # the next step's scale K: the global count of the last step that had one (a device scalar)
        self.mb_target_shape = None
        self._ones = None  # average=False: every micro-batch's (keep, weight), made once

    def begin(self, targets: torch.Tensor, m: int) -> None:
        """The last stage's step begins: its micro-batches' weights, scaled by the previous step's global count
        (the first step all-reduces its own; nothing is weighted with average=False)."""
        if not self.average:
            return
        counts = loss_weights.micro_batch_counts(targets, m, self.ignore_index)
        self.mb_target_shape = targets.chunk(m)[0].shape
        # a gradient group of one rank: this step's own count is the global one, no collective (nor scaling)
        own = self.scale is None or self._exact()
        scale = loss_weights.global_count(counts, self.plan) if own else self.scale
        self.weights = loss_weights.StepWeights(counts, scale, self.plan)

    def __call__(self, out, target, index: int | None = None):
        """Micro-batch `index`'s share of the step's loss (the schedule says which; pipelining computes one
        extra loss on its first step, on empty tensors: counted from its own targets)."""
        split = self.vocab_parallel is not None and self.vocab_parallel.active
        if self.weights is None:
            return self.vocab_parallel(out, target, *self.gate(0, target.device)) if split else self.loss_fn(out, target)
        if index is None or target.shape != self.mb_target_shape:
            if split:
                return self.vocab_parallel(out, target, *loss_weights.own_weights(
                    target, self.weights.scale(), self.plan, self.ignore_index))
            return loss_weights.weighted(self.loss_fn, out, target, self.weights.scale(), self.plan,
                                         self.ignore_index)
        keep, weight = self.weights(index)  # float64: cast to the loss's dtype (a bf16 output's loss may be fp32)
        if split:
            return self.vocab_parallel(out, target, keep, weight)
        if self._compiled is not None:
            try:
                return self._compiled(out, target, keep, weight)
            # refused while tracing, before anything ran (fullgraph: a graph break, or past Dynamo's recompile limit)
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
                self._compiled = None
                warnings.warn(f"gradsched: loss_fn could not be compiled ({str(e).splitlines()[0]}); it runs "
                              "eagerly after the last stage's graph, op by op (more host time per micro-batch). "
                              "Make it traceable by torch.compile(fullgraph=True) to remove that.", stacklevel=2)
        return loss_weights.gated(self.loss_fn, out, target, keep, weight)

    def gate(self, index: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `index`'s (keep, weight) for a loss computed in the stage's graph
        (loss_weights.gated, in_graph=True): with average=False, (True, 1). Each of shape [1]: Dynamo would take a 0-d
        float tensor input for a Python number, fail to keep it a tensor and trace the graph twice."""
        if self.weights is not None:
            return self.weights(index)
        if self._ones is None or self._ones[0].device != device:
            self._ones = torch.ones(1, dtype=torch.bool, device=device), torch.ones(1, dtype=torch.float64, device=device)
        return self._ones

    def issue(self, sync, losses: list) -> nonfinite.Issued | None:
        """pp 1, after the last micro-batch's forward (`losses`: every micro-batch's): where every rank's reduced
        gradients will be finite alike (nonfinite.reduced_alike: shard=False, or sharded buckets that spread a
        non-finite element), the step's gather issued now, to hide
        behind the last backward; `end` waits for it. None otherwise (`end` gathers)."""
        if not nonfinite.reduced_alike(sync):
            return None
        self._loss_row(sync, losses)
        return nonfinite.issue_step(sync, WHAT, losses[-1].device)

    def end(self, sync, losses: list | None, issued: nonfinite.Issued | None = None):
        """The step's one collective, at its end, on every rank of the plan (or `issue`'s, waited for here): every
        rank's non-finite flags, the last stage's labelled counts and loss shares beside them; then the reduced
        gradients are scaled to the global batch's mean. Returns the step's loss where `losses` (this rank's
        micro-batch losses) is given, else None."""
        flags, w = sync.nonfinite, self.weights
        mark = False  # this rank's reduced-gradient flag made with the arithmetic (issued: every rank's alike)
        if issued is not None:
            rows = nonfinite.wait_issued(sync, issued)
            mark = len(sync.reduced()) == len(sync.sync_plan.layout.buckets)
            if not mark:  # local gradients, not reduced ones
                nonfinite.finish_step(sync, rows)
        else:
            if losses is not None:
                self._loss_row(sync, losses)
            device = next(iter(sync.params.values())).device
            nonfinite.agree_step(sync, torch.zeros(0, dtype=torch.float64, device=device), what=WHAT)
            rows = flags.agreed
        scale = w.scale() if w is not None else None
        rescale = self.average and not self._exact()
        grads = sync.reduced_storage() if mark or rescale else []
        loss, factor, next_scale, own = end_arithmetic(rows, grads, scale, self.average, mark, rescale)
        if mark:
            flags.agreed, flags.own_grads = rows, own
        flags.loss = loss  # non-finite: the optimizer's step refuses it (nonfinite.check)
        if next_scale is not None:
            self.scale = next_scale
        if losses is None:
            return None
        # float32, as torch's losses are for half-precision models; a float64 model's in float64
        return loss.to(torch.float64 if next(iter(sync.params.values())).dtype == torch.float64 else torch.float32)

    def _exact(self) -> bool:
        """The weights' K is this step's global count N on every rank (a gradient group of one rank holds the
        whole global batch: dp = cp = 1): the reduced gradients are the global mean's, K / N exactly 1."""
        return len(self.plan.group_ranks("grad")) == 1

    def _loss_row(self, sync, losses: list) -> None:
        """This rank's loss, checked once, through its share (non-finite exactly when it is), beside its labelled
        count and scale K."""
        w = self.weights
        share = loss_weights.step_share(losses, self.plan, self.average)
        zero = torch.zeros_like(share)  # average=False: no count, no scale
        row = torch.stack([w.counts.sum(), share, w.scale()] if w is not None else [zero, share, zero])
        # tp > 1: every TP rank holds the same loss of the same tokens; one of them counts it (times 0 keeps a NaN)
        sync.nonfinite.loss_row = row if self.plan.index("tp") == 0 else row * 0


@torch.no_grad()
def end_arithmetic(rows: torch.Tensor, grads: list, scale, average: bool, mark: bool, rescale: bool = True):
    """(loss, factor, next scale, marker), after the step's row gather (`rows`: [world, SLOTS], every rank's):
    the step's loss and K / N (loss_weights.step_result); `grads`, the tensors holding this rank's reduced
    gradients (GradSync.reduced_storage: the buckets or shards, a few tensors), scaled by it in place; the next
    step's K (None without a `scale`); and with `mark` (every rank's reduced gradients alike), this rank's
    marker of them before the scaling (nonfinite.marker_of), else None. rescale=False: K was N (GlobalLoss._exact),
    nothing to scale or carry to the next step (at N = 0 the loss is NaN and the step refused, gradients zero).
    Over the buckets, not each parameter's .grad: a pass a bucket, not ops a parameter. (Compiled by Inductor it ran no faster on a CPU core: what is
    left is the ~10 ops' dispatch, and each model would pay a compile.)"""
    counts = rows[:, nonfinite.COUNT]
    loss, factor = loss_weights.step_result(counts, rows[:, nonfinite.SHARE], rows[:, nonfinite.SCALE], average)
    marker = nonfinite.marker_of(grads, rows.device) if mark else None
    next_scale = None
    if factor is not None and rescale:
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, same in by_dtype.items():  # one dtype a call: foreach's fast path (mixed, it loops: 10x slower)
            torch._foreach_mul_(same, factor.to(torch.float64 if dtype == torch.float64 else torch.float32))
        if scale is not None:
            next_scale = loss_weights.next_scale(scale, counts)
    return loss, factor, next_scale, marker


def _compiled_gated(loss_fn):
    """loss_weights.gated over `loss_fn`, traced whole and compiled by Inductor (its gate a fused `where`): one
    graph a micro-batch instead of ~10 eager ops and an autograd Function, forward and backward. The shapes are
    the same every step under pp > 1 (ParallelModel checks them)."""
    def gated_loss(out, target, keep, weight):
        return loss_weights.gated(loss_fn, out, target, keep, weight, in_graph=True)
    # a code object of its own: Dynamo caches per code object, and models built in one process (each with its
    # loss_fn and shapes) would otherwise share one cache and its recompile limit
    own = types.FunctionType(gated_loss.__code__.replace(), gated_loss.__globals__, "gated_loss",
                             gated_loss.__defaults__, gated_loss.__closure__)
    return torch.compile(own, backend="inductor", fullgraph=True, dynamic=False)
