"""Attention priced as a device would run it, for the dry run's meta tensors.

On the meta device, F.scaled_dot_product_attention takes the math path: it materialises the [B, H, S, S]
scores and keeps them for the backward, which no GPU kernel does (flash and memory-efficient attention
keep the output and a [B, H, S] log-sum-exp). A plan sized that way is wrong by an order of magnitude at
long sequences. `priced_as(device)` replaces F.scaled_dot_product_attention, for meta tensors only, with
the aten kernel that device picks for the call's dtype and mask, whose meta kernels give the true shapes
of what it returns and saves:

    cuda, fp16/bf16, no mask    _scaled_dot_product_flash_attention (grouped-query heads as they are)
    cuda, fp32 or a mask        _scaled_dot_product_efficient_attention (a boolean mask as a float bias)
    cpu                         _scaled_dot_product_flash_attention_for_cpu

Context parallelism lowers attention to its own kernels, which already choose by device (cp.attention_kernels):
this stand-in is for cp == 1. Dropout is priced as none (its mask is not kept by these kernels either).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from gradsched.cp.ring_blocks import expand_heads

DEVICES = ("cuda", "cpu")


def _bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))


def _attention(device: str, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if device == "cpu":
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
    if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[0]
    k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _bias(attn_mask, q), True, 0.0, is_causal, scale=scale)[0]


@contextlib.contextmanager
def priced_as(device: str):
    """Inside, attention on meta tensors runs as `device`'s kernel (see the module docstring); other tensors'
    attention is untouched."""
    if device not in DEVICES:
        raise ValueError(f"attention can be priced as one of {DEVICES}, not {device!r}")
    original = F.scaled_dot_product_attention

    @torch._dynamo.allow_in_graph  # one node in the graph, so that tensor parallelism splits it by heads as SDPA
    def sdpa(query, key, value, *args, **kwargs):
        if not query.is_meta:
            return original(query, key, value, *args, **kwargs)
        return _attention(device, query, key, value, *args, **kwargs)
    sdpa.computes_sdpa = True  # passes/tp_roles.is_sdpa: SDPA's arguments and results

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
