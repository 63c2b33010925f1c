"""A CPU stand-in for flash-attn 2.x, built as flash-attn is: ops in the `flash_attn` namespace
(registered with torch.library) called inside a torch.autograd.Function, behind `flash_attn_func`
with [B, L, H, D] tensors. Enough for Dynamo to trace exactly what it traces in a real model."""
import torch
import torch.nn.functional as F


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    scores = qt @ kt.transpose(-1, -2) * softmax_scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores.softmax(-1) @ vt).transpose(1, 2).contiguous(), lse


@_flash_attn_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal):
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("flash_attn::_flash_attn_backward", mutates_args=())
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=softmax_scale).transpose(1, 2)
        return torch.autograd.grad(out, (q, k, v), dout)


@_flash_attn_backward.register_fake
def _(dout, q, k, v, softmax_scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal):
        out, _ = torch.ops.flash_attn._flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal)
        ctx.save_for_backward(q, k, v)
        ctx.softmax_scale, ctx.causal = softmax_scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.ops.flash_attn._flash_attn_backward(dout, q, k, v, ctx.softmax_scale, ctx.causal)
        return dq, dk, dv, None, None, None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return FlashAttnFunc.apply(q, k, v, dropout_p, scale, causal)
