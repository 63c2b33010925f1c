"""The block math of one ring window on one rank: kernel calls (gradsched.cp.attention_kernels),
the LSE merge of block outputs, and the dq/dK/dV sums, in the accumulation dtype
(see gradsched.cp.ring_attention's "Numerics"). Shared by the ring and the simulation.
"""
from __future__ import annotations

import math

import torch

from gradsched.cp.attention_kernels import attend, attend_backward, dq_tile, upcast_operands
from gradsched.cp.ring_schedule import Piece, Ring, plan_calls, rounds_results

def expand_heads(x, q_heads: int):
    """K/V with kv heads -> q heads (head j of q reads kv head j // groups), for the kernel."""
    b, h, n, d = x.shape
    if h == q_heads:
        return x
    return x[:, :, None].expand(b, h, q_heads // h, n, d).reshape(b, q_heads, n, d)


def reduce_heads(g, kv_heads: int, dtype: torch.dtype):
    """Gradient over q heads -> over kv heads, summed in `dtype`."""
    b, h, n, d = g.shape
    g = g.to(dtype)
    if h == kv_heads:
        return g
    return g.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def merge_block(out, lse, block_out, block_lse, dtype: torch.dtype, empty_rows: bool = False):
    """Fold one block's normalised attention into a running result (None: the first block).

    Both are softmax-normalised over their own keys; weighting each by exp(its LSE -
    the joint LSE) gives attention over the union of keys. `out` is kept in `dtype`,
    LSE in float32. The same function serves the ring, the masked ring and the simulation.
    empty_rows: some rows may have seen no key yet (LSE -inf on both sides, under masks);
    their weights are then taken against 0 instead of -inf (which would give NaN).
    """
    block_out = block_out.to(dtype)
    if out is None:
        return block_out, block_lse
    joint = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isinf(joint), torch.zeros_like(joint), joint) if empty_rows else joint
    w_run = torch.exp(lse - ref).unsqueeze(-1).to(dtype)
    w_blk = torch.exp(block_lse - ref).unsqueeze(-1).to(dtype)
    return out * w_run + block_out * w_blk, joint


def operands(ring: Ring, *xs):
    """The block kernel's operands: fp32 where "fp32_blocks" runs an aten kernel (which returns
    its operands' dtype); as given for the Triton kernel, which returns fp32 itself."""
    x = xs[0]
    if upcast_operands(x.device.type, x.dtype, ring.accumulate):
        return tuple(x.float() for x in xs)
    return xs


def call_keys(pieces: list[Piece], ring: Ring, rows: int, dtype: torch.dtype):
    """One kernel call's K, V (pieces in sequence order), is_causal and attn_mask.

    Only the rows' own (diagonal) chunk is causal, and it comes last: with as many
    keys as rows the block is a causal square; with more, causal aligned to the bottom
    right (the CPU kernel's is_causal is top-left aligned), given as a mask.
    """
    ks = [p.k.chunk(ring.parts, dim=2)[p.index] for p in pieces]
    vs = [p.v.chunk(ring.parts, dim=2)[p.index] for p in pieces]
    k, v = (ks[0], vs[0]) if len(pieces) == 1 else (torch.cat(ks, 2), torch.cat(vs, 2))
    k, v = operands(ring, k, v)
    n = k.shape[2]
    if not pieces[-1].diag:
        return k, v, False, None
    if n == rows:  # a causal square (one diagonal chunk, or the local square)
        return k, v, True, None
    hidden = torch.ones(rows, n, dtype=torch.bool, device=k.device).triu(n - rows + 1)
    mask = torch.zeros(rows, n, dtype=dtype, device=k.device).masked_fill(hidden, float("-inf"))
    return k, v, False, mask



def forward_window(state: list, q, rows: list, window, ring: Ring) -> None:
    """Attend the local rows to what they see of the window's K/V (see `plan_calls`), merging
    into `state` ([out, lse] per row chunk) in place. q: all local rows; rows: its chunks."""
    heads = q.shape[1]
    dtype = ring.acc_dtype(q.dtype)
    (q,) = operands(ring, q)
    rows = operands(ring, *rows)
    for parts, pieces in plan_calls(ring, window, rounds_results(q.dtype)):
        x = rows[parts[0]] if len(parts) == 1 else q
        k, v, causal, mask = call_keys(pieces, ring, x.shape[2], x.dtype)
        out, lse = attend(x, expand_heads(k, heads), expand_heads(v, heads), causal,
                           ring.scale, mask, ring.accumulate)
        outs = (out,) if len(parts) == 1 else out.chunk(len(parts), dim=2)
        lses = (lse,) if len(parts) == 1 else lse.chunk(len(parts), dim=2)
        for p, o, l in zip(parts, outs, lses):
            state[p][0], state[p][1] = merge_block(state[p][0], state[p][1], o, l, dtype)


def row_chunks(x, parts: int) -> list:
    return [c.contiguous() for c in x.chunk(parts, dim=2)] if parts > 1 else [x]


def finish_forward(state: list, dtype: torch.dtype, ring: Ring):
    """(out in the input dtype, LSE fp32, the out to save for backward)."""
    out = torch.cat([s[0] for s in state], dim=2) if len(state) > 1 else state[0][0]
    lse = torch.cat([s[1] for s in state], dim=2) if len(state) > 1 else state[0][1]
    final = out.to(dtype)
    return final, lse, (out if ring.accumulate == "fp32_blocks" else final)


def rows_for_backward(ring: Ring, q, out, dout, lse) -> list[tuple]:
    """(q, out, dout, lse) of all local rows, then of each local row chunk; operands in
    the block dtype."""
    q, out, dout = operands(ring, q, out, dout)
    dout = dout.contiguous()
    return [(q, out, dout, lse)] + list(zip(*(row_chunks(x, ring.parts)
                                              for x in (q, out, dout, lse))))


def backward_window(dq: list, rows: list, window, grads: dict, ring: Ring, kshape, vshape):
    """Gradients of every call of the window (see `plan_calls`): dq added into `dq` (per row
    chunk) in place, dk/dv into `grads` (`add_kv_grads`; `pop_kv_grads` makes a step's flat
    dK/dV). rows: `rows_for_backward`."""
    heads = rows[0][0].shape[1]
    dtype = dq[0].dtype
    x = rows[0][0]
    for parts, pieces in plan_calls(ring, window, rounds_results(x.dtype), dq_tile(x.device.type, x.dtype)):
        q, out, dout, lse = rows[1 + parts[0]] if len(parts) == 1 else rows[0]
        k, v, causal, mask = call_keys(pieces, ring, q.shape[2], q.dtype)
        gq, gk, gv = attend_backward(dout, q, expand_heads(k, heads), expand_heads(v, heads),
                                      out, lse, causal, ring.scale, mask, ring.accumulate)
        for p, g in zip(parts, (gq,) if len(parts) == 1 else gq.chunk(len(parts), dim=2)):
            dq[p] += g
        gk = reduce_heads(gk, kshape[1], dtype).split(kshape[2] // ring.parts, dim=2)
        gv = reduce_heads(gv, vshape[1], dtype).split(vshape[2] // ring.parts, dim=2)
        for piece, dk, dv in zip(pieces, gk, gv):
            add_kv_grads(grads, piece.step, piece.index, dk, dv)


# dK/dV are collected per (step, chunk) and joined by one cat when a step's share is complete, not
# added into slices of a zeroed flat buffer: Inductor lowers slice-adds into one masked loop over the
# whole buffer (32 ms of a 400 ms rank at cp 2, S 4096, bf16 on CPU). The flat dK/dV interleave dk
# and dv per head ([B, H, 2, parts, L/parts, D]) so that the cat is the only copy (8 ms less at cp 4
# than [dk | dv]); they travel and sum in that layout, and `unflat_kv_grads` reads it back.

def add_kv_grads(grads: dict, step: int, index: int, dk, dv) -> None:
    """Add one call's dK/dV of chunk `index` of the K/V held at `step` into grads[step]."""
    got = grads.setdefault(step, {})
    if index in got:
        got[index] = (got[index][0] + dk, got[index][1] + dv)
    else:
        got[index] = (dk, dv)


def pop_kv_grads(grads: dict, step: int, parts: int, kshape, dtype, device):
    """The flat dK/dV of the K/V held at `step` (chunks no call touched: zeros), removed from
    `grads`; None when no call touched that K/V. K and V have one shape (comm.check_attention_call refuses
    other value head sizes: the block kernels take one)."""
    got = grads.pop(step, None)
    if got is None:
        return None

    def piece(which: int, j: int):
        if j in got:
            return got[j][which]
        return torch.zeros((*kshape[:2], kshape[2] // parts, *kshape[3:]), dtype=dtype, device=device)
    return torch.cat([piece(t, j).unsqueeze(2) for t in (0, 1) for j in range(parts)], dim=2).reshape(-1)


def unflat_kv_grads(flat, kshape, parts: int):
    """(dk, dv) from a flat dK/dV made by `pop_kv_grads` (or summed from such)."""
    b, h, n, d = kshape
    x = flat.view(b, h, 2, parts, n // parts, d)
    return x[:, :, 0].reshape(kshape), x[:, :, 1].reshape(kshape)


def flat_kv(k, v):
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def unflat_kv(kv, kshape, vshape):
    nk = math.prod(kshape)
    return kv[:nk].view(kshape), kv[nk:].view(vshape)
