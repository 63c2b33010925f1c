"""Attention masks from a model's own inputs (public API; the implementation is gradsched.cp.attention_masks).

    from gradsched.masks import attention
    out = attention(q, k, v, causal=True, window=4096, position_ids=pos, key_padding=pad, seq_idx=docs)

One call, one node in the traced graph: the context-parallel pass lowers it to a ring, Ulysses or
hybrid step with the same masks; in one process it runs as dense attention.
"""
from gradsched.cp.attention_masks import attention, dense_mask, document_ids, positions_from_cu_seqlens, visible

__all__ = ["attention", "dense_mask", "document_ids", "positions_from_cu_seqlens", "visible"]
