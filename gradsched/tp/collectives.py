"""The collectives `passes/tensor_parallel.py` inserts into the forward graph, over the TP group.

Each is a torch.autograd.Function over functional collectives (plain tensors in eager and under
tracing), so AOTAutograd traces its backward into the backward graph:

  gather_sequence   forward all-gather along `dim`;    backward reduce-scatter (the gathered value
                    feeds rank-distinct work, whose gradients are partial sums)
  scatter_sequence  forward reduce-scatter along `dim` (a partial sum becomes this rank's
                    sequence shard); backward all-gather
  grad_sum          forward identity; backward all-reduce: a parameter replicated over TP sees only
                    this rank's share of the work, so its gradient is the sum of every rank's
  gather_output     forward all-gather along `dim`;    backward this rank's chunk only (every rank
                    computes the same loss from the gathered value: summing would count it tp times)
  scatter_input     forward this rank's chunk along `dim` of a value every TP rank holds whole (a
                    pipeline stage's received activation); backward all-gather, so the gradient sent
                    back is whole and equal on every TP rank, as gather_output's backward expects
"""
from __future__ import annotations

import torch

c10d = torch.ops._c10d_functional


def _all_gather(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """Concatenation along `dim` of every rank's `x`, in rank order: gathered along dim 0 as they are (no
    copy of a contiguous input), then one concatenation, as funcol's all_gather_tensor does."""
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), size, group))
    return out if dim == 0 else torch.cat(out.chunk(size, 0), dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """This rank's chunk along `dim` of the sum over ranks of `x`: the chunks stacked along dim 0 (one copy),
    reduce-scattered there, so the result needs no copy."""
    x = x.contiguous() if dim == 0 else torch.cat(x.chunk(size, dim), 0)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", size, group))


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.args = dim, group, size
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, *ctx.args), None, None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.args = dim, group, size
        return _reduce_scatter(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, *ctx.args), None, None, None


class _GradSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _GatherOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size, rank):
        ctx.args = dim, x.shape[dim], rank
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        dim, n, rank = ctx.args
        return g.narrow(dim, rank * n, n).contiguous(), None, None, None, None


class _ScatterInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size, rank):
        ctx.args = dim, group, size
        n = x.shape[dim] // size
        return x.narrow(dim, rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, *ctx.args), None, None, None, None


def gather_sequence(x, dim: int, group: str, size: int):
    return _GatherSequence.apply(x, dim, group, size)


def scatter_sequence(x, dim: int, group: str, size: int):
    return _ScatterSequence.apply(x, dim, group, size)


def grad_sum(w, group: str):
    return _GradSum.apply(w, group)


def gather_output(x, dim: int, group: str, size: int, rank: int):
    return _GatherOutput.apply(x, dim, group, size, rank)


def scatter_input(x, dim: int, group: str, size: int, rank: int):
    return _ScatterInput.apply(x, dim, group, size, rank)
