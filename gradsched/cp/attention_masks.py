"""Attention masks from a model's own inputs: sliding windows, packed documents, padding.

One call, `attention(q, k, v, causal=, window=, position_ids=, key_padding=)`, says what a
model attends to in terms the context-parallel lowering can keep: a window in tokens (a
Python int), and two per-token tensors. In one process it is SDPA with the mask built
here; under context parallelism the lowering pass (passes.context_parallel) turns it into
the ring or Ulysses with the same arguments, where the per-token tensors are each rank's
slice in gradsched.cp.layout's order and the ring builds each block's part of the mask.

Conventions (Hugging Face's, so that an HF model trains as in one process):
- window W: query i sees key j only if i - j < W (masking_utils.sliding_window_overlay);
  always together with causal attention.
- documents: position ids that do not step by exactly 1 start a new document
  (masking_utils.find_packed_sequence_indices): `document_ids`. Explicit boundaries
  (`cu_seqlens`) become such position ids with `positions_from_cu_seqlens`.
- padding: key_padding[b, j] False hides key j from every query (HF masks keys only).
- explicit documents: seq_idx [B, S] (HF's name, DataCollatorWithFlattening(return_seq_idx=True)):
  tokens attend within equal seq_idx only, causally in sequence order, and a window is measured on
  position_ids. This is what lets a document keep its meaning when its tokens are not contiguous:
  the document-balanced layout (gradsched.cp.layout, load_balance="documents") spreads every
  document over all context-parallel ranks, in pieces.

A query that sees no key at all (a left pad) gets zeros: every kernel here reports such a row's
log-sum-exp as 0, finite, and its gradients as zeros.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from gradsched.passes.context_parallel import effective_window


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] position ids in natural order -> [B, S] document index (0, 1, ...): a new document
    wherever the position does not step by exactly 1."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Document boundaries [0, n1, n1+n2, ..., S] (flash-attn's cu_seqlens) -> [1, S] position
    ids restarting at 0 in every document, the form `attention` takes."""
    total = int(cu_seqlens[-1]) if total is None else total
    idx = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens[torch.searchsorted(cu_seqlens, idx, right=True) - 1]
    return (idx - starts)[None]


def visible(q_idx, k_idx, *, causal: bool, window: int | None, q_doc=None, k_doc=None,
            k_keep=None, q_pos=None, k_pos=None) -> torch.Tensor:
    """Which keys each query sees: bool [B or 1, Lq, Lk]. q_idx/k_idx: global token indices
    ([Lq], [Lk]); q_doc/k_doc: document ids ([B, Lq], [B, Lk]); k_keep: bool [B, Lk] (False:
    padding); q_pos/k_pos ([B, Lq], [B, Lk]): positions to measure the window on instead of
    the indices (documents in pieces: within a document they differ as its positions do)."""
    qi, kj = q_idx[:, None], k_idx[None, :]
    seen = torch.ones(qi.shape[0], kj.shape[1], dtype=torch.bool, device=q_idx.device)
    if causal:
        seen = seen & (kj <= qi)
    if window is not None and q_pos is None:
        seen = seen & (qi - kj < window)
    seen = seen[None]
    if window is not None and q_pos is not None:
        seen = seen & (q_pos[:, :, None] - k_pos[:, None, :] < window)
    if q_doc is not None:
        seen = seen & (q_doc[:, :, None] == k_doc[:, None, :])
    if k_keep is not None:
        seen = seen & k_keep[:, None, :].bool()
    return seen


def normalize_masks(seq_len: int, window, position_ids, key_padding, seq_idx):
    """(window, position_ids, masked) as the ring applies them to a call over seq_len tokens: a window
    over the whole sequence is dropped, and explicit documents (seq_idx) without a window need no
    positions (they would only measure the window)."""
    window = effective_window(window, seq_len)
    if seq_idx is not None and window is None:
        position_ids = None
    masked = window is not None or position_ids is not None or key_padding is not None or seq_idx is not None
    return window, position_ids, masked


def check_mask_args(call: str, *, causal: bool, window, position_ids, key_padding, seq_len: int | None,
                    batch: int | None, seq_idx=None) -> None:
    """Refuse what `attention` cannot mean, naming the argument."""
    from gradsched.cp.comm import unsupported
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise unsupported(call, f"window={window!r} is not a positive number of tokens",
                              "Pass the model's sliding window as an int, or None for full attention.")
        if not causal:
            raise unsupported(call, "a sliding window without causal attention",
                              "Windows are causal (query i sees keys i-window+1..i): pass causal=True.")
    if seq_idx is not None and window is not None and position_ids is None:
        raise unsupported(call, "a window with seq_idx but no position_ids",
                          "With explicit documents (seq_idx) the window is measured on positions: pass "
                          "position_ids as well.")
    for name, t in (("position_ids", position_ids), ("key_padding", key_padding), ("seq_idx", seq_idx)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise unsupported(call, f"{name} must be a 2-D tensor [batch, sequence], got "
                              f"{getattr(t, 'shape', type(t).__name__)}", f"Pass {name} as [B, S].")
        if seq_len is not None and t.shape[1] != seq_len:
            raise unsupported(call, f"{name} covers {t.shape[1]} tokens, and the queries {seq_len}",
                              f"Pass {name} for the same tokens as q (each rank's slice under context "
                              "parallelism).")
        if batch is not None and t.shape[0] not in (1, batch):
            raise unsupported(call, f"{name} has batch {t.shape[0]}, and q {batch}", "Pass one row per "
                              "sequence, or one row for all.")


def token_masks(position_ids, seq_idx):
    """(document ids, positions to measure a window on) of gradsched.cp.attention_masks' conventions: explicit
    documents (seq_idx) with their positions, or documents found in the position ids (None
    positions: the window is measured on the sequence index, the same within a document)."""
    if seq_idx is not None:
        return seq_idx, position_ids
    return (document_ids(position_ids) if position_ids is not None else None), None


def dense_mask(seq_len: int, device, *, causal: bool, window: int | None, position_ids=None,
               key_padding=None, seq_idx=None) -> torch.Tensor | None:
    """The bool mask [B or 1, 1, S, S] of a whole sequence in sequence order (None: full)."""
    if not causal and window is None and position_ids is None and key_padding is None and seq_idx is None:
        return None
    idx = torch.arange(seq_len, device=device)
    doc, pos = token_masks(position_ids, seq_idx)
    return visible(idx, idx, causal=causal, window=window, q_doc=doc, k_doc=doc,
                   k_keep=key_padding, q_pos=pos, k_pos=pos)[:, None]


def _dense_attention(q, k, v, causal, scale, window, position_ids, key_padding, seq_idx=None):
    if window is None and position_ids is None and key_padding is None and seq_idx is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    mask = dense_mask(q.shape[2], q.device, causal=causal, window=window, position_ids=position_ids,
                      key_padding=key_padding, seq_idx=seq_idx)
    # SDPA with a bool mask gives a query that sees nothing zeros, and zero gradients.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# A custom op, not a Python function: Dynamo and torch.export (the pipeline split) both keep it as
# one node, so the context-parallel lowering finds its window, positions and padding as arguments.
# In one process its body runs eagerly; its backward recomputes the forward under autograd.
@torch.library.custom_op("gradsched::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                  window: Optional[int], position_ids: Optional[torch.Tensor],
                  key_padding: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _dense_attention(q, k, v, causal, scale, window, position_ids, key_padding, seq_idx).contiguous()


@_attention_op.register_fake
def _(q, k, v, causal, scale, window, position_ids, key_padding, seq_idx=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("gradsched::attention_backward", mutates_args=())
def _attention_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                           scale: Optional[float], window: Optional[int], position_ids: Optional[torch.Tensor],
                           key_padding: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The block kernels' own backward (gradsched.cp.attention_kernels), after recomputing out and LSE with
    # their forward: a custom op's body runs below autograd, so it cannot differentiate its forward again.
    # Memory: the [B, 1, S, S] mask, not the [B, H, S, S] fp32 scores written-out math would take.
    from gradsched.cp.attention_kernels import attend, attend_backward
    from gradsched.cp.ring_blocks import expand_heads, reduce_heads

    heads = q.shape[1]
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kh, vh = expand_heads(k, heads), expand_heads(v, heads)
    mask = dense_mask(q.shape[2], q.device, causal=causal, window=window, position_ids=position_ids,
                      key_padding=key_padding, seq_idx=seq_idx)
    add = None if mask is None else \
        torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    is_causal = causal and mask is None
    out, lse = attend(q, kh, vh, is_causal, s, add)
    if mask is not None:  # a query that sees nothing: zero out, and an LSE that gives its keys no weight
        blind = ~mask.any(-1)
        out, lse = out.masked_fill(blind[..., None], 0.0), lse.masked_fill(blind, 0.0)
    dq, dk, dv = attend_backward(grad.contiguous(), q, kh, vh, out, lse, is_causal, s, add)
    dk, dv = (reduce_heads(g, k.shape[1], torch.promote_types(k.dtype, torch.float32)).to(k.dtype)
              for g in (dk, dv))  # GQA sums in fp32 or wider
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_backward_op.register_fake
def _(grad, q, k, v, causal, scale, window, position_ids, key_padding, seq_idx=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the body returns


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.rest = inputs[3:]


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = torch.ops.gradsched.attention_backward(grad, q, k, v, *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup)


def attention(q, k, v, causal: bool = True, scale: float | None = None, window: int | None = None,
              position_ids: torch.Tensor | None = None, key_padding: torch.Tensor | None = None,
              seq_idx: torch.Tensor | None = None):
    """Attention with a sliding window, packed documents and padding given as what they are.

    q [B, Hq, S, D], k/v [B, Hkv, S, D] (Hq a multiple of Hkv); window: tokens (causal only);
    position_ids [B or 1, S]: documents (a new one where positions do not step by 1); key_padding
    [B or 1, S] bool: False hides that key; seq_idx [B or 1, S]: explicit documents (then
    position_ids only measure the window, and documents need not be contiguous). One node (torch.ops.gradsched.attention) in a traced
    graph, which passes.context_parallel lowers to the ring or Ulysses with the same arguments.
    """
    check_mask_args("gradsched.attention", causal=causal, window=window, position_ids=position_ids,
                    key_padding=key_padding, seq_len=q.shape[2], batch=q.shape[0], seq_idx=seq_idx)
    if window is None and position_ids is None and key_padding is None and seq_idx is None:  # plain SDPA
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if key_padding is not None:
        key_padding = key_padding.bool()
    if seq_idx is not None and window is None:
        position_ids = None  # explicit documents: positions would only measure the window
    return torch.ops.gradsched.attention(q, k, v, causal, scale, window, position_ids, key_padding, seq_idx)
