"""How evenly a context-parallel layout spreads attention work: visible (query, key) pairs per rank.

The load-balanced layout (gradsched.cp.layout: rank r holds chunks r and 2cp-1-r) gives every rank the
same causal work over ONE sequence. Packed documents break that: a query sees only its own document, so
a rank holding the ends of long documents does more than one holding short ones. This measures it, for
the head-tail layout and for the document-balanced one (load_balance="documents": every rank holds a
near-equal piece of every document, gradsched.cp.layout.document_order).

Visible pairs are the work of a kernel that skips what the mask hides (flash-attn's varlen, a
block-sparse kernel); the CPU kernel with a mask tensor computes the whole block either way.
"""
from __future__ import annotations

import torch

from gradsched.cp.layout import document_order, shard_index
from gradsched.cp.attention_masks import document_ids, visible


def pairs_per_rank(position_ids: torch.Tensor, cp: int, *, load_balance: bool | str = True, causal: bool = True,
                   window: int | None = None) -> list[int]:
    """Visible (query, key) pairs of each rank's queries, summed over the batch. position_ids: [B, S],
    natural order (HF packing: a new document wherever positions do not step by 1)."""
    seq = position_ids.shape[-1]
    doc = document_ids(position_ids)
    idx = torch.arange(seq, device=position_ids.device)
    per_query = visible(idx, idx, causal=causal, window=window, q_doc=doc, k_doc=doc).sum(-1)  # [B, S]
    if load_balance == "documents":  # each row reordered first: the same pairs, other ranks
        per_query = per_query.gather(1, document_order(position_ids, cp))
    per_query = per_query.sum(0)
    return [int(per_query[shard_index(seq, cp, r, bool(load_balance), per_query.device)].sum()) for r in range(cp)]


def imbalance(work: list[int]) -> float:
    """The busiest rank's work over the mean: 1.0 is even; the step waits for the busiest."""
    return max(work) * len(work) / sum(work)
