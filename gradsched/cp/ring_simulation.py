"""The ring, every rank in turn, in one process: the same blocks, merges and sums in the same
order as gradsched.cp.ring_attention (bit for bit with comm="ring"), without a process group.
For numerics against fp64 and for timing one rank's compute against the limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsched.cp.ring_blocks import (backward_window, finish_forward, forward_window, pop_kv_grads, row_chunks,
                                      rows_for_backward, unflat_kv_grads)
from gradsched.cp.layout import shard, unshard
from gradsched.cp.attention_masks import check_mask_args, normalize_masks
from gradsched.cp.comm import check_attention_call, check_masked_call, unsupported
from gradsched.cp.ring_masked import MaskedRing, natural_tokens
from gradsched.cp.ring_masked import rank_backward as masked_backward
from gradsched.cp.ring_masked import rank_forward as masked_forward
from gradsched.cp.ring_schedule import BACKWARD_WINDOW, Ring, fewest_roundings_default, forward_ends, window_ends

def _cut(x, cp: int, load_balance: bool) -> list[torch.Tensor]:
    """Every rank's shard of a whole-sequence [B, H, S, D] tensor, in rank order."""
    return [shard(x, cp, r, dim=2, load_balance=load_balance).contiguous() for r in range(cp)]


def rank_forward(ring: Ring, q, ks, vs):
    """Rank ring.rank's forward with every rank's K/V at hand (ks, vs: per rank):
    (out, LSE, out to save), as _ring_forward computes them."""
    rows = row_chunks(q, ring.parts)
    state = [[None, None] for _ in range(ring.parts)]
    for window in rank_windows(ring, forward_ends(ring), ks, vs):
        forward_window(state, q, rows, window, ring)
    return finish_forward(state, q.dtype, ring)


def rank_backward(ring: Ring, q, ks, vs, dout, lse, saved_out):
    """Rank ring.rank's backward with every K/V at hand: (dq in the accumulation dtype,
    {step: flat dK/dV of the K/V held at that step})."""
    rows = rows_for_backward(ring, q, saved_out, dout, lse)
    dtype = ring.acc_dtype(q.dtype)
    dq = [torch.zeros(x[0].shape, dtype=dtype, device=q.device) for x in rows[1:]]
    grads = {}
    for window in rank_windows(ring, window_ends(ring.cp, BACKWARD_WINDOW), ks, vs):
        backward_window(dq, rows, window, grads, ring, ks[0].shape, vs[0].shape)
    flat = {s: pop_kv_grads(grads, s, ring.parts, ks[0].shape, dtype, q.device) for s in list(grads)}
    return (torch.cat(dq, dim=2) if len(dq) > 1 else dq[0]), flat


def _checked(call, q, k, v, cp, causal, load_balance, accumulate, fewest_roundings, masked: bool = False) -> bool:
    """Refuse what the ring would refuse (inputs over the whole sequence); the resolved
    fewest_roundings."""
    if fewest_roundings is None:
        fewest_roundings = fewest_roundings_default(q.device.type, cp, masked)
    check_attention_call(call, q_heads=q.shape[1], kv_heads=k.shape[1], local_len=q.shape[2] // cp, cp=cp,
                         causal=causal, load_balance=load_balance, accumulate=accumulate,
                         fewest_roundings=fewest_roundings, device_type=q.device.type,
                         head_dims=(q.shape[-1], k.shape[-1], v.shape[-1]))
    return fewest_roundings


def rank_compute(q, k, v, dout, cp: int, rank: int, causal: bool = False,
                 accumulate: str = "fp32", *, load_balance: bool = True,
                 fewest_roundings: bool | None = None):
    """A function running one rank's share of the ring's compute (forward and backward
    blocks, merges and sums, no communication): to time the schedule against the limit,
    one full-sequence kernel's time / cp. Inputs as simulate_ring's, on any device."""
    fewest_roundings = _checked("rank_compute", q, k, v, cp, causal, load_balance, accumulate, fewest_roundings)
    scale = 1.0 / math.sqrt(q.shape[-1])
    ks, vs = (_cut(x, cp, load_balance) for x in (k, v))
    ql, dl = (shard(x, cp, rank, dim=2, load_balance=load_balance).contiguous() for x in (q, dout))

    def run():  # the ring is made inside, as in _RingAttention.forward, so that Dynamo traces it
        ring = Ring(rank, cp, causal, load_balance, scale, accumulate,
                     fewest_roundings=fewest_roundings)
        out, lse, saved = rank_forward(ring, ql, ks, vs)
        return rank_backward(ring, ql, ks, vs, dl, lse, saved)
    return run


@dataclass
class SimResult:
    """Full-sequence results in natural token order (grads None without grad_out)."""
    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None


def rank_windows(ring: Ring, ends: set[int], ks, vs):
    """The ring's windows on one rank, each ending at a step of `ends`: lists of
    (step, src, k, v)."""
    window = []
    for step in range(ring.cp):
        src = (ring.rank - step) % ring.cp
        window.append((step, src, ks[src], vs[src]))
        if step in ends:
            yield window
            window = []


def masked_rings(q, cp: int, causal: bool, load_balance: bool, scale: float, accumulate: str, window,
                 per_token: bool, fewest_roundings: bool, window_on_positions: bool = False) -> list[MaskedRing]:
    parts = 2 if load_balance and cp > 1 else 1
    return [MaskedRing(r, cp, causal, load_balance, scale, accumulate, q.shape[2] // (cp * parts), window,
                       per_token, fewest_roundings, window_on_positions=window_on_positions) for r in range(cp)]


def simulate_masked_ring(q, k, v, cp: int, causal: bool, accumulate: str, *, scale: float, load_balance: bool,
                         grad_out, fewest_roundings: bool, window, position_ids, key_padding,
                         seq_idx=None) -> SimResult:
    """simulate_ring with masks: gradsched.cp.ring_masked's blocks, merges and sums on every rank in
    turn, dK/dV summed at their owner in step order, as the ring sums them."""

    check_mask_args("simulate_ring", causal=causal, window=window, position_ids=position_ids,
                    key_padding=key_padding, seq_len=q.shape[2], batch=q.shape[0], seq_idx=seq_idx)
    check_masked_call("simulate_ring", comm="ring", cp=cp, local_len=q.shape[2] // cp, load_balance=load_balance)
    rings = masked_rings(q, cp, causal, load_balance, scale, accumulate, window,
                         any(t is not None for t in (position_ids, key_padding, seq_idx)), fewest_roundings,
                         window_on_positions=seq_idx is not None)
    tokens = natural_tokens(position_ids, key_padding, seq_idx)

    qs, ks, vs = (_cut(x, cp, load_balance) for x in (q, k, v))

    def kv_at(r):
        return lambda step: (ks[(r - step) % cp], vs[(r - step) % cp])

    done = [masked_forward(ring, qs[r], kv_at(r), tokens) for r, ring in enumerate(rings)]
    result = SimResult(unshard([f[0] for f in done], cp, dim=2, load_balance=load_balance),
                       unshard([f[1] for f in done], cp, dim=2, load_balance=load_balance))
    if grad_out is None:
        return result
    douts = _cut(grad_out, cp, load_balance)
    dtype = rings[0].acc_dtype(q.dtype)
    got = [dict() for _ in range(cp)]  # got[owner][step]: the dK/dV of the rank holding owner's K/V at step
    dqs = []
    for r, ring in enumerate(rings):
        def give_back(step, dkv, r=r):
            got[(r - step) % cp][step] = dkv
        dqs.append(masked_backward(ring, qs[r], douts[r], done[r][2], done[r][1], kv_at(r), tokens,
                                   ks[0].shape, vs[0].shape, give_back))
    dks, dvs = [], []
    for owner in range(cp):
        dkv = torch.zeros(ks[0].numel() + vs[0].numel(), dtype=dtype, device=q.device)
        for step in sorted(got[owner]):
            dkv.add_(got[owner][step])
        dk, dv = unflat_kv_grads(dkv, ks[0].shape, len(rings[owner].chunks(owner)))
        dks.append(dk.to(k.dtype))
        dvs.append(dv.to(v.dtype))
    result.dq = unshard([d.to(q.dtype) for d in dqs], cp, dim=2, load_balance=load_balance)
    result.dk = unshard(dks, cp, dim=2, load_balance=load_balance)
    result.dv = unshard(dvs, cp, dim=2, load_balance=load_balance)
    return result


def simulate_ring(q, k, v, cp: int, causal: bool = False, accumulate: str = "fp32", *,
                  scale: float | None = None, load_balance: bool = True,
                  grad_out: torch.Tensor | None = None,
                  fewest_roundings: bool | None = None, window: int | None = None,
                  position_ids: torch.Tensor | None = None,
                  key_padding: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None) -> SimResult:
    """Run the cp-rank ring on one device: same blocks, merges and sums, in the same order.

    q, k, v (and grad_out) cover the whole sequence in natural order ([B, H, S, D]); they
    are cut into the cp_layout shards, every rank's steps run in turn, and the results
    are put back in natural order. Masks (window, position_ids, key_padding, seq_idx:
    gradsched.cp.attention_masks) over the whole sequence in sequence order run the masked ring
    (gradsched.cp.ring_masked).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    window, position_ids, masked = normalize_masks(q.shape[2], window, position_ids, key_padding, seq_idx)
    fewest_roundings = _checked("simulate_ring", q, k, v, cp, causal, load_balance, accumulate, fewest_roundings,
                                masked)
    if masked:
        return simulate_masked_ring(q, k, v, cp, causal, accumulate, scale=float(scale), load_balance=load_balance,
                                    grad_out=grad_out, fewest_roundings=fewest_roundings, window=window,
                                    position_ids=position_ids, key_padding=key_padding, seq_idx=seq_idx)
    if q.shape[2] % cp:
        raise unsupported("simulate_ring", f"the sequence length {q.shape[2]} is not divisible "
                           f"by cp={cp}", "Pad the sequence.")
    rings = [Ring(r, cp, causal, load_balance, float(scale), accumulate,
                   fewest_roundings=fewest_roundings) for r in range(cp)]

    qs, ks, vs = (_cut(x, cp, load_balance) for x in (q, k, v))
    finished = [rank_forward(ring, qs[r], ks, vs) for r, ring in enumerate(rings)]
    result = SimResult(unshard([f[0] for f in finished], cp, dim=2, load_balance=load_balance),
                       unshard([f[1] for f in finished], cp, dim=2, load_balance=load_balance))
    if grad_out is None:
        return result

    douts = _cut(grad_out, cp, load_balance)
    dtype = rings[0].acc_dtype(q.dtype)
    kshape = ks[0].shape
    # grads[r][step]: rank r's dK/dV for the K/V it holds at step
    dqs, grads = zip(*(rank_backward(ring, qs[r], ks, vs, douts[r], *finished[r][1:])
                       for r, ring in enumerate(rings)))
    dkvs = []
    for src in range(cp):  # summed in ring order, starting at the owner, as the ring does
        dkv = None
        for step in range(cp):
            mine = grads[(src + step) % cp].get(step)
            if mine is not None:
                dkv = mine if dkv is None else dkv.add_(mine)
        dkvs.append(dkv if dkv is not None else
                    torch.zeros(ks[0].numel() + vs[0].numel(), dtype=dtype, device=q.device))
    dks, dvs = zip(*(unflat_kv_grads(d, kshape, rings[0].parts) for d in dkvs))
    result.dq = unshard([d.to(q.dtype) for d in dqs], cp, dim=2, load_balance=load_balance)
    result.dk = unshard([d.to(k.dtype) for d in dks], cp, dim=2, load_balance=load_balance)
    result.dv = unshard([d.to(v.dtype) for d in dvs], cp, dim=2, load_balance=load_balance)
    return result
