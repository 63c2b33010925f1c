"""Block attention kernels: one call over a block of keys, returning its log-sum-exp.

The ring (gradsched.ring_attention) folds block results together through their LSE, so
it needs kernels that return it, and a backward that takes the merged out and LSE of
the whole row. Which aten kernel runs is a function of the device, the operand dtype
and whether the block needs a mask tensor (`choose_kernel`):

    cpu                          _scaled_dot_product_flash_attention_for_cpu (any dtype, mask)
    cuda, fp16/bf16, no mask     _scaled_dot_product_flash_attention (tensor cores)
    cuda, fp32 or a mask         _scaled_dot_product_efficient_attention

`is_causal` is used only for square blocks (equal query and key lengths), where every
kernel agrees on what it means (top-left and bottom-right alignment coincide).
"""
from __future__ import annotations

import torch

KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient")
CPU_KV_TILE = 512
"""Keys per tile of the CPU flash kernel (kvSplitSize). Its backward adds each tile's dq
into its output in the input dtype, so past one tile its dq sum rounds more than ours."""


class KernelError(ValueError):
    """No block kernel for this device."""


def choose_kernel(device_type: str, dtype: torch.dtype, has_mask: bool) -> str:
    """The kernel for a block: see the module docstring."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and not has_mask:
            return "cuda_flash"
        return "cuda_efficient"
    raise KernelError(f"ring attention has no block kernel for device {device_type!r}: it runs on "
                      "'cpu' and 'cuda'. Move the model to one of them, or keep attention out of "
                      "context parallelism (cp=1).")


def dq_tile(device_type: str, dtype: torch.dtype) -> int | None:
    """Most keys one backward call should take, so that the kernel's own dq sum (in the
    input dtype) spans no more than one tile; None: the kernel sums dq in fp32."""
    if device_type == "cpu" and torch.finfo(dtype).bits < 32:
        return CPU_KV_TILE
    return None


def _bias(mask, q):
    """An additive mask as the efficient kernel takes it: 4-D, its rows 16-aligned."""
    if mask is None:
        return None
    rows, n = mask.shape
    padded = torch.nn.functional.pad(mask, (0, -n % 16))[:, :n]
    return padded.expand(q.shape[0], q.shape[1], rows, n)


def attend(q, k, v, causal: bool, scale: float, mask=None):
    """One block: (out in q's dtype, LSE float32 [B, H, Lq]). q, k, v: [B, H, L, D]."""
    kernel = choose_kernel(q.device.type, q.dtype, mask is not None)
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    if kernel == "cuda_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _bias(mask, q), True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[2]].contiguous()  # its LSE is padded to 32 rows


def attend_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """Gradients (dq, dk, dv) of one block, given the merged out and LSE of its rows."""
    kernel = choose_kernel(q.device.type, q.dtype, mask is not None)
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    if kernel == "cuda_flash":
        # No dropout: the RNG state is unused; dense blocks have no cumulative lengths.
        rng = torch.empty(0, dtype=torch.uint64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng,
            scale=scale)
    lse = torch.nn.functional.pad(lse, (0, -q.shape[2] % 32))
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    bias = _bias(mask, q)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, seed, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv
