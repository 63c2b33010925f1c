"""Cross-entropy over vocab-parallel logits, never gathering them (the TP pass puts it in place of
F.cross_entropy when the logits reaching it are split over the vocabulary).

Each rank holds logits[:, lo:lo + n] of the N x V logits. In fp32, the row maximum, the sum of
exponentials and the target's logit are reduced over TP (two all-reduces: the maximum's of N values, then
the sums' of 2 x N, 3 x N with the rows' logit sums under label smoothing); the loss is then what one process computes, with
`ignore_index`, `reduction` and label smoothing over the whole vocabulary. The backward is local:
softmax minus the target's one-hot (smoothed), restricted to this rank's columns.
"""
from __future__ import annotations

import torch

c10d = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), op, group))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, lo, vocab, group, ignore_index, reduction, smoothing):
        x = logits if logits.dtype == torch.float64 else logits.float()
        n = x.shape[-1]
        row_max = _all_reduce(x.amax(dim=-1), "max", group)
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        inside = (target >= lo) & (target < lo + n)
        local = (target - lo) * inside
        picked = torch.where(inside, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)  # -inf * 0 is NaN
        # the sums over TP in one all-reduce: the exponentials', the target's logit and (smoothing) the logits'
        sums = [exp.sum(dim=-1), picked] + ([shifted.sum(dim=-1)] if smoothing else [])
        sums = _all_reduce(torch.stack(sums), "sum", group)
        lse = sums[0].log()  # log-sum-exp less the row maximum
        loss = lse - sums[1]
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (lse - sums[2] / vocab)
        valid = target != ignore_index
        loss = loss * valid
        count = valid.sum()
        ctx.save_for_backward(exp, lse, local, inside, valid, count)
        ctx.args = reduction, smoothing, vocab, logits.dtype
        if reduction == "sum":
            return loss.sum()
        if reduction == "mean":
            return loss.sum() / count
        return loss

    @staticmethod
    def backward(ctx, g):
        exp, lse, local, inside, valid, count = ctx.saved_tensors
        reduction, smoothing, vocab, dtype = ctx.args
        grad = exp / lse.exp().unsqueeze(-1)  # this rank's columns of the softmax
        hit = torch.zeros_like(grad).scatter_(-1, local.unsqueeze(-1), inside.unsqueeze(-1).to(grad.dtype))
        grad = grad - (1 - smoothing) * hit - smoothing / vocab
        scale = valid.to(grad.dtype) * (g if reduction == "none" else g / count if reduction == "mean" else g)
        return (grad * scale.unsqueeze(-1)).to(dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, lo: int, vocab: int, group: str, ignore_index: int = -100,
                                 reduction: str = "mean", label_smoothing: float = 0.0):
    """F.cross_entropy(whole logits, target, ...) from this rank's columns [lo, lo + n) of the logits ([N, n])."""
    return _VocabParallelCrossEntropy.apply(logits, target, lo, vocab, group, ignore_index, reduction,
                                            label_smoothing)
