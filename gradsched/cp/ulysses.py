"""Ulysses attention (comm="a2a"): context parallelism by heads instead of by sequence.

Each rank of the CP group holds its slice of the sequence for every head. One all-to-all
turns that into the whole sequence for cp-th of the heads; the attention runs unchanged
on it (the single device's kernel, mask and numerics: nothing is merged); a second
all-to-all turns the output back. DeepSpeed-Ulysses' scheme, as functional collectives
that trace under torch.compile.

It needs the query heads divisible by cp, and the key/value heads divisible by cp, or
dividing it: then each key/value head is repeated cp / kv_heads times before the
all-to-all, so each rank receives the one head its query heads read (GQA groups stay
whole). Other head counts are refused (gradsched.cp.comm) with the ring as the way out.

Ranks hold their tokens in gradsched.cp.layout's order (with load_balance, chunks r and
2cp-1-r), so the gathered sequence is put into natural order before the attention (a
causal mask is a mask of positions) and back after.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gradsched.cp.layout import layout_order
from gradsched.cp.attention_masks import visible
from gradsched.cp.ring_masked import gather_tokens

_c10d = torch.ops._c10d_functional


def _all_to_all(x: torch.Tensor, cp: int, group_name: str) -> torch.Tensor:
    """Equal-sized all-to-all of x's dim 0 (cp parts): part j goes to rank j, part i comes from rank i."""
    out = _c10d.all_to_all_single(x.contiguous().view(-1), [x.numel() // cp] * cp, [x.numel() // cp] * cp,
                                  group_name)
    return _c10d.wait_tensor(out).view(x.shape)


def _seq_to_heads(x: torch.Tensor, cp: int, group_name: str) -> torch.Tensor:
    """[B, H, L, D] (this rank's tokens, every head) -> [B, H/cp, cp*L, D] (every rank's tokens in
    rank order, this rank's heads)."""
    B, H, L, D = x.shape
    parts = x.view(B, cp, H // cp, L, D).transpose(0, 1)  # part j: the heads rank j computes
    got = _all_to_all(parts, cp, group_name)  # [cp (source rank), B, H/cp, L, D]
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * L, D)


def _heads_to_seq(x: torch.Tensor, cp: int, group_name: str) -> torch.Tensor:
    """The inverse of _seq_to_heads."""
    B, h, S, D = x.shape
    parts = x.view(B, h, cp, S // cp, D).permute(2, 0, 1, 3, 4)  # part j: rank j's tokens
    got = _all_to_all(parts, cp, group_name)  # [cp (source rank: its heads), B, h, L, D]
    return got.transpose(0, 1).reshape(B, cp * h, S // cp, D)


class _Redistribute(torch.autograd.Function):
    """Sequence to heads (to_heads=True) or heads to sequence, with its adjoint: the other way.
    The all-to-all is a permutation of elements across ranks, so the gradient goes back the way
    the values came."""

    @staticmethod
    def forward(ctx, x, cp, group_name, to_heads):
        ctx.args = (cp, group_name, to_heads)
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, cp, group_name)

    @staticmethod
    def backward(ctx, g):
        cp, group_name, to_heads = ctx.args
        return (_heads_to_seq if to_heads else _seq_to_heads)(g, cp, group_name), None, None, None


class _KVToHeads(torch.autograd.Function):
    """Key/value heads to the query heads this rank computes, over the whole sequence in natural
    order: repeated up to cp if fewer, all-to-all, reordered, repeated to the local query heads.

    Its backward sums the gradient of every query head that read a key/value head in fp32 and
    rounds once, as the single device's repeat does (its sum accumulates in fp32): the copies'
    gradients travel back in fp32 when a head was repeated over ranks, else they are summed
    over the local query heads first and travel in the input dtype."""

    @staticmethod
    def forward(ctx, x, cp, group_name, order, natural, q_heads):
        B, H, L, D = x.shape
        reps = cp // H if H % cp else 1
        ctx.args, ctx.dtype = (cp, group_name, reps, B, H, L, D), x.dtype
        ctx.save_for_backward(order)
        y = _seq_to_heads(x.repeat_interleave(reps, 1) if reps > 1 else x, cp, group_name)
        y = y.index_select(2, natural)
        ctx.local_reps = q_heads // y.shape[1]
        return y.repeat_interleave(ctx.local_reps, 1) if ctx.local_reps > 1 else y

    @staticmethod
    def backward(ctx, g):
        cp, group_name, reps, B, H, L, D = ctx.args
        (order,) = ctx.saved_tensors
        h = g.shape[1] // ctx.local_reps
        g = g.to(torch.promote_types(g.dtype, torch.float32)).view(B, h, ctx.local_reps, cp * L, D).sum(2).index_select(2, order)
        if reps == 1:  # no copies on other ranks: round here, travel in the input dtype
            return _heads_to_seq(g.to(ctx.dtype), cp, group_name), None, None, None, None, None
        g = _heads_to_seq(g, cp, group_name).view(B, H, reps, L, D).sum(2)
        return g.to(ctx.dtype), None, None, None, None, None


def ulysses_attention(q, k, v, group_name: str, cp: int, *, causal: bool, scale: float,
                      load_balance: bool, window: int | None = None, position_ids=None,
                      key_padding=None, seq_idx=None) -> torch.Tensor:
    """q: [B, Hq, L, D], k/v: [B, Hkv, L, D], this rank's tokens in the cp_layout order; returns
    out [B, Hq, L, Dv] in the same order. A window, documents (position_ids) or padding
    (key_padding), each rank's slice as q, become the whole sequence's mask (gradsched.cp.attention_masks)."""
    mask = None
    if window is not None or position_ids is not None or key_padding is not None or seq_idx is not None:
        seq = q.shape[2] * cp
        doc, keep, pos = gather_tokens(position_ids, key_padding, cp, group_name, load_balance, seq, seq_idx)
        idx = torch.arange(seq, device=q.device)
        mask = visible(idx, idx, causal=causal, window=window, q_doc=doc, k_doc=doc, k_keep=keep,
                       q_pos=pos, k_pos=pos)[:, None]
    order = layout_order(q.shape[2] * cp, cp, load_balance, device=q.device)  # slot -> position
    natural = torch.argsort(order)  # position -> slot
    q = _Redistribute.apply(q, cp, group_name, True).index_select(2, natural)
    # GQA: the key/value heads expanded to this rank's query heads, as a single device's call sees them
    k, v = (_KVToHeads.apply(t, cp, group_name, order, natural, q.shape[1]) for t in (k, v))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    else:  # a bool mask: a query that sees nothing gets zeros, as in one process
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _Redistribute.apply(out.index_select(2, order), cp, group_name, False)
