"""Hybrid context parallelism (comm="hybrid"): all-to-all over a sub-group, ring over the rest.

The CP group of cp = a * r ranks splits into all-to-all groups of a consecutive ranks and ring
groups across them (gradsched.cp.groups). An all-to-all (Ulysses, gradsched.cp.ulysses) turns each
rank's slice of the sequence for every head into its group's joint slice for a-th of the heads;
the ring (gradsched.cp.ring_attention, masks included) runs over the r groups on those heads; a
second all-to-all turns the output back. With a = cp it is Ulysses, with a = 1 the ring.

Why it needs no layout of its own: in the load-balanced layout over cp ranks (rank i holds chunks
i and 2cp-1-i of 2cp), the a ranks of all-to-all group j together hold chunks ja .. ja+a-1 and
2cp-a-ja .. 2cp-1-ja, which are exactly chunks j and 2r-1-j of the load-balanced layout over r
ranks. The gathered tokens only need putting in that order (`joint_order`): early halves by
member, then late halves by member reversed. Without load balancing the members' chunks are
already consecutive.

GQA: key/value heads are split over the a ranks when a divides them, else (a multiple of them)
each is repeated to the ranks whose query heads read it, as in Ulysses; the ring takes the
grouped heads as they are. gradsched.cp.comm refuses other head counts.
"""
from __future__ import annotations

import torch

from gradsched.cp.groups import hybrid_groups
from gradsched.cp.ulysses import _heads_to_seq, _KVToHeads, _Redistribute

_c10d = torch.ops._c10d_functional


def joint_order(a2a: int, local_len: int, load_balance: bool, device=None) -> torch.Tensor:
    """For each slot of the all-to-all group's joint slice (in the ring's layout over cp / a2a
    ranks), the index of that token in the members' slices laid end to end."""
    if not load_balance:
        return torch.arange(a2a * local_len, device=device)
    c = local_len // 2
    early = [torch.arange(m * local_len, m * local_len + c, device=device) for m in range(a2a)]
    late = [torch.arange(m * local_len + c, (m + 1) * local_len, device=device) for m in reversed(range(a2a))]
    return torch.cat(early + late)


def _joint_tokens(t, a2a: int, group_name: str, order: torch.Tensor):
    """Per-token metadata ([B', L], integers or bools) of the whole all-to-all group, in the ring's
    order: one all-gather (not differentiable)."""
    if t is None:
        return None
    got = _c10d.wait_tensor(_c10d.all_gather_into_tensor(t.long().contiguous(), a2a, group_name))
    rows, n = t.shape
    laid = got.view(a2a, rows, n).transpose(0, 1).reshape(rows, a2a * n)
    laid = laid.index_select(1, order)
    return laid.bool() if t.dtype == torch.bool else laid.to(t.dtype)


def hybrid_attention(q, k, v, group_name: str, cp: int, a2a: int, *, ring_call, causal: bool, scale: float,
                     load_balance: bool, return_lse: bool = False, position_ids=None, key_padding=None,
                     seq_idx=None, **ring_kwargs):
    """q: [B, Hq, L, D], k/v: [B, Hkv, L, D], this rank's slice in gradsched.cp.layout's order over
    the CP group `group_name` (cp ranks); out in the same order (and the LSE if return_lse).
    `ring_call` is gradsched.cp.ring_attention.ring_attention (comm="ring" over the ring groups)."""
    a2a_group, ring_group = hybrid_groups(group_name, a2a)
    L = q.shape[2]
    order = joint_order(a2a, L, load_balance, device=q.device)  # joint slot -> gathered index
    back = torch.argsort(order)
    q = _Redistribute.apply(q, a2a, a2a_group, True).index_select(2, order)
    kv_heads = k.shape[1]
    local_kv = kv_heads // a2a if kv_heads % a2a == 0 else 1
    k, v = (_KVToHeads.apply(t, a2a, a2a_group, back, order, local_kv) for t in (k, v))
    position_ids = _joint_tokens(position_ids, a2a, a2a_group, order)
    key_padding = _joint_tokens(key_padding, a2a, a2a_group, order)
    seq_idx = _joint_tokens(seq_idx, a2a, a2a_group, order)
    out, lse = ring_call(q, k, v, ring_group, causal=causal, scale=scale, load_balance=load_balance,
                         comm="ring", return_lse=True, position_ids=position_ids, key_padding=key_padding,
                         seq_idx=seq_idx, **ring_kwargs)
    out = _Redistribute.apply(out.index_select(2, back), a2a, a2a_group, False)
    if not return_lse:
        return out
    lse = _heads_to_seq(lse.index_select(2, back).unsqueeze(-1), a2a, a2a_group).squeeze(-1)
    return out, lse
