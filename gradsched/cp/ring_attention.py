"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Each rank of the CP group holds a slice of the sequence (q, k, v: [B, H, L_local, D]).
The keys and values travel around the group; each rank attends its queries to every
slice in turn and folds the block results together through their log-sum-exp (LSE),
which gives attention over the whole sequence. The backward pass runs its own ring:
K/V travel again (only the local q, k, v, out and LSE are saved, so saved memory does
not grow with cp), and the K/V gradients travel with them back to their owner.

Layout (gradsched.cp.layout makes it): with causal attention and load_balance=True
the sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r, so every
rank does the same work. At ring step i rank r holds the K/V of rank s = (r - i) mod cp;
the block it computes follows from the chunk positions (see `Ring.visible`):

    s == r   the local causal square: is_causal=True with equal q and k lengths
    s <  r   all local rows x the early K/V chunk of s, fully visible
    s >  r   the late local rows x all K/V of s, fully visible

Without load balancing (rank r holds chunk r of cp) the steps with s > r compute
nothing, but their collectives still run: every rank issues the same collectives in
the same order, whatever it computes.

Kernel calls (gradsched.cp.attention_kernels runs them): the blocks above are cut per local
row chunk. Blocks that are fully masked are never computed, and every diagonal block is a
square the kernel computes with its own causal path (is_causal), so a rank computes what
its rows see and nothing else. The fully visible blocks of a window of ring steps share
one call (forward: step 0 alone, so that it computes while the next K/V travel, then
FORWARD_WINDOW = 3 steps, whose K/V a rank keeps until the window ends; backward: 2
steps). With a reduced input dtype a kernel rounds each call's result (block out; block
dq) to that dtype, so fewer, larger calls are also fewer roundings. `fewest_roundings`
goes one further: a row chunk whose whole attention lies in one window gets ONE call
(causal aligned to the bottom right, as a mask tensor), as accurate as the kernel over
the whole sequence but slower, as the kernels compute a masked block densely. In
backward the dK/dV of the K/V held at step t travel on at step t+1 (one step behind the
K/V), so that a window can finish them. Saved for backward: only the local q, k, v, out
and LSE; transient: up to 3 visiting K/V.

Numerics (`accumulate`):
    "fp32"         blocks run in the input dtype; outs merge in fp32, dq/dk/dv sum in
                   fp32 (dk/dv travel in fp32); one cast to the input dtype at the end.
    "input"        merge and sum in the input dtype (TransformerEngine's default).
    "fp32_blocks"  as "fp32", and each block runs with fp32 operands and outputs, so
                   nothing is rounded before the final cast.

Everything in forward and backward is aten ops and `_c10d_functional` collectives, so
the ring traces under torch.compile(fullgraph=True) and under AOTAutograd.

Modules of gradsched.cp, one concern each: comm (which scheme runs a call, comm="auto", and
what each refuses), ring_schedule (which calls a rank makes), attention_kernels (the block
kernel per backend), ring_blocks (one window's calls, merges and sums), this module (the
collectives and the autograd Function), ring_simulation (every rank in turn in one process,
for numerics and kernel timing; bit for bit the ring's results with comm="ring"). Other
schemes: ulysses (comm="a2a"), hybrid (comm="hybrid", over the sub-groups of groups).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gradsched.cp.ring_blocks import (backward_window, finish_forward, flat_kv, forward_window, pop_kv_grads,
                                      row_chunks, rows_for_backward, unflat_kv, unflat_kv_grads)
from gradsched.cp.attention_masks import check_mask_args, normalize_masks
from gradsched.cp.keep import Uses, anchored
from gradsched.cp.comm import (ACCUMULATE_MODES, COMM_MODES, RingAttentionError, check_attention_call,
                               check_masked_call)
from gradsched.cp.ring_masked import MaskedRingAttention
from gradsched.cp.ring_schedule import BACKWARD_WINDOW, Ring, forward_ends, fewest_roundings_default, window_ends

_c10d = torch.ops._c10d_functional

# ---- collectives ----------------------------------------------------------------------

def _send_to_next(flat, ring: Ring):
    """Every rank sends `flat` to rank+1 and receives rank-1's (one all_to_all_single)."""
    n = flat.numel()
    recv = [0] * ring.cp
    send = [0] * ring.cp
    recv[(ring.rank - 1) % ring.cp] = n
    send[(ring.rank + 1) % ring.cp] = n
    return _c10d.all_to_all_single(flat, recv, send, ring.group_name)


def _wait(t):
    return _c10d.wait_tensor(t)


def _all_gather(flat, ring: Ring):
    out = _wait(_c10d.all_gather_into_tensor(flat, ring.cp, ring.group_name))
    return out.view(ring.cp, -1)


# ---- the ring on one rank -------------------------------------------------------------

def _ring_forward(q, k, v, ring: Ring):
    rows = row_chunks(q, ring.parts)
    state = [[None, None] for _ in range(ring.parts)]
    kv = flat_kv(k, v)
    uses = Uses()  # a rank that skips a step still uses what it received (gradsched.cp.keep)
    gathered = uses.keep(_all_gather(kv, ring)) if ring.comm == "allgather" and ring.cp > 1 else None
    ends = forward_ends(ring)
    pending, window = None, []
    for step in range(ring.cp):
        src = (ring.rank - step) % ring.cp
        if gathered is not None:
            kv = gathered[src]
        else:
            if step > 0:
                kv = uses.keep(_wait(pending))
            if step < ring.cp - 1:
                pending = _send_to_next(kv, ring)  # in flight while this step computes
        window.append((step, src, *unflat_kv(kv, k.shape, v.shape)))
        if step in ends:
            forward_window(state, q, rows, window, ring)
            window = []
    out, lse, saved = finish_forward(state, q.dtype, ring)
    return uses.tie(out), lse, saved


def _ring_backward(dout, q, k, v, out, lse, ring: Ring):
    """The backward ring. K/V travel as in forward; a window of BACKWARD_WINDOW (2) steps
    is computed at its end, so the dK/dV of the K/V held at step t are complete one step
    later: every rank sends them on at step t+1 (rank r+1 holds that K/V at step t+1 and
    completes its share at step t+2). Same collectives, in the same order, on every rank.
    """
    rows = rows_for_backward(ring, q, out, dout, lse)
    dtype = ring.acc_dtype(q.dtype)
    dq = [torch.zeros(r[0].shape, dtype=dtype, device=q.device) for r in rows[1:]]
    kv = anchored(flat_kv(k, v), dout)  # re-sent in the backward, never merged with the forward's
    uses = Uses()
    allgather = ring.comm == "allgather" and ring.cp > 1
    if allgather:
        gathered = uses.keep(_all_gather(kv, ring))
        dkv_all = torch.zeros((ring.cp, kv.numel()), dtype=dtype, device=q.device)
    ends = window_ends(ring.cp, BACKWARD_WINDOW)
    pending_kv = pending_dkv = None
    grads, window = {}, []
    for step in range(ring.cp + 1):
        if step < ring.cp:
            src = (ring.rank - step) % ring.cp
            if allgather:
                kv = gathered[src]
            else:
                if step > 0:
                    kv = uses.keep(_wait(pending_kv))
                if step < ring.cp - 1:
                    pending_kv = _send_to_next(kv, ring)
            window.append((step, src, *unflat_kv(kv, k.shape, v.shape)))
            if step in ends:
                backward_window(dq, rows, window, grads, ring, k.shape, v.shape)
                window = []
        if step == 0 or ring.cp == 1:
            continue
        done = step - 1  # the K/V held at step - 1
        mine = pop_kv_grads(grads, done, ring.parts, k.shape, dtype, q.device)
        if allgather:
            if mine is not None:
                dkv_all[(ring.rank - done) % ring.cp] += mine
            continue
        if done == 0:  # our own K/V: its dK/dV starts here
            dkv = mine if mine is not None else \
                anchored(torch.zeros(kv.numel(), dtype=dtype, device=q.device), dout)
        else:  # as summed by the ranks before this one
            dkv = _wait(pending_dkv)
            if mine is not None:
                dkv.add_(mine)
        pending_dkv = _send_to_next(dkv, ring)
    if allgather:
        dkv = _wait(_c10d.reduce_scatter_tensor(dkv_all.view(-1), "sum", ring.cp, ring.group_name))
    elif ring.cp > 1:
        dkv = _wait(pending_dkv)  # our own K/V's gradient, back from the last rank
    else:
        dkv = pop_kv_grads(grads, 0, ring.parts, k.shape, dtype, q.device)
        if dkv is None:
            dkv = torch.zeros(kv.numel(), dtype=dtype, device=q.device)
    dk, dv = unflat_kv_grads(dkv, k.shape, ring.parts)
    dq = torch.cat(dq, dim=2) if len(dq) > 1 else dq[0]
    return uses.tie(dq.to(q.dtype)), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group_name, rank, cp, causal, scale, accumulate, comm, load_balance,
                fewest_roundings):
        ring = Ring(rank, cp, causal, load_balance, scale, accumulate, group_name, comm,
                     fewest_roundings)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, saved_out = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, saved_out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.ring)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


@torch.compiler.assume_constant_result
def group_rank_and_size(group) -> tuple[int, int]:
    """(rank, size) of this process in a group given by name or ProcessGroup.

    Constant for a process, so torch.compile runs it once while tracing.
    """
    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


def ring_attention(q, k, v, group_name: str, *, causal: bool = False, scale: float | None = None,
                   accumulate: str = "fp32", comm: str = "ring", load_balance: bool = True,
                   return_lse: bool = False, call: str = "ring_attention",
                   fewest_roundings: bool | None = None, window: int | None = None,
                   position_ids: torch.Tensor | None = None, key_padding: torch.Tensor | None = None,
                   a2a_degree: int | None = None, seq_idx: torch.Tensor | None = None):
    """Attention of local q over the K/V of every rank of the CP group `group_name`.

    q: [B, Hq, L, D], k/v: [B, Hkv, L, D] with Hq a multiple of Hkv; each rank holds its
    slice of the sequence in the layout of gradsched.cp.layout (same `load_balance`).
    Returns out [B, Hq, L, Dv] (and the LSE, float32 [B, Hq, L], if return_lse). `call`
    names the caller's attention call in errors. fewest_roundings: in a reduced dtype, join a
    row chunk's calls of a window, diagonal included (a bottom-right causal mask tensor), so
    each row's output is rounded fewer times; the kernels compute masked blocks densely, so it
    is slower (benchmarks/cp_speed.py shows both). None: on for the CPU kernel where the fast
    schedule would round a row's output more than twice (cp > 4) or the call is masked
    (`fewest_roundings_default`).

    Masks (gradsched.cp.attention_masks' conventions): `window` (tokens, causal only), `position_ids` (documents:
    a new one wherever positions do not step by 1) and `key_padding` (bool, False: a pad), the
    latter two [B or 1, L], this rank's slice in the same layout as q; `seq_idx` [B or 1, L]:
    explicit documents (the document-balanced layout), the window then measured on position_ids. The ring then runs
    gradsched.cp.ring_masked (steps with nothing to compute skipped); comm='a2a' applies the mask to
    its whole-sequence call.

    comm='hybrid': all-to-all over groups of `a2a_degree` consecutive CP ranks (None: the largest the
    heads allow), ring over the rest (gradsched.cp.hybrid). comm='auto': gradsched.cp.comm picks.
    """
    requested = fewest_roundings  # None: decided by the ring that runs (a hybrid's is smaller than cp)
    rank, cp = group_rank_and_size(group_name)
    check_mask_args(call, causal=causal, window=window, position_ids=position_ids, key_padding=key_padding,
                    seq_len=q.shape[2], batch=q.shape[0], seq_idx=seq_idx)
    window, position_ids, masked = normalize_masks(q.shape[2] * cp, window, position_ids, key_padding, seq_idx)
    if fewest_roundings is None:
        fewest_roundings = fewest_roundings_default(q.device.type, cp, masked)
    choice = check_attention_call(call, q_heads=q.shape[1], kv_heads=k.shape[1], local_len=q.shape[2],
                                  cp=cp, causal=causal, load_balance=load_balance, accumulate=accumulate,
                                  comm=comm, fewest_roundings=fewest_roundings, device_type=q.device.type,
                                  a2a_degree=a2a_degree, masked=masked, needs_lse=return_lse,
                                  head_dims=(q.shape[-1], k.shape[-1], v.shape[-1]))
    comm = choice.comm
    if masked:
        check_masked_call(call, comm=comm, cp=cp, local_len=q.shape[2], load_balance=load_balance)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if comm == "hybrid" and 1 < choice.a2a < cp:  # a2a over a sub-group x ring over the rest
        from gradsched.cp.hybrid import hybrid_attention
        return hybrid_attention(q, k, v, group_name, cp, choice.a2a, ring_call=ring_attention, causal=causal,
                                scale=float(scale), load_balance=load_balance, return_lse=return_lse,
                                position_ids=position_ids, key_padding=key_padding, seq_idx=seq_idx,
                                accumulate=accumulate,
                                fewest_roundings=requested, window=window, call=call)
    if comm == "hybrid":  # a degree of cp is Ulysses, of 1 the ring
        comm = "a2a" if choice.a2a == cp else "ring"
    if comm == "a2a":  # by heads: one unchanged attention call on the whole sequence (gradsched.cp.ulysses)
        if return_lse:
            raise RingAttentionError(f"{call}: comm='a2a' returns no log-sum-exp. Use comm='ring' for calls "
                                     "that return it (flash-attn's return_attn_probs / LSE).")
        from gradsched.cp.ulysses import ulysses_attention
        return ulysses_attention(q, k, v, group_name, cp, causal=causal, scale=float(scale),
                                 load_balance=load_balance, window=window, position_ids=position_ids,
                                 key_padding=key_padding, seq_idx=seq_idx)
    if masked:
        out, lse = MaskedRingAttention.apply(q, k, v, position_ids, key_padding, seq_idx, group_name, rank, cp,
                                             causal,
                                             float(scale), accumulate, load_balance, window,
                                             bool(fewest_roundings))
        return (out, lse) if return_lse else out
    out, lse = _RingAttention.apply(q, k, v, group_name, rank, cp, causal, float(scale),
                                    accumulate, comm, load_balance, bool(fewest_roundings))
    return (out, lse) if return_lse else out


__all__ = ["ACCUMULATE_MODES", "COMM_MODES", "RingAttentionError", "check_attention_call", "group_rank_and_size",
           "ring_attention"]
