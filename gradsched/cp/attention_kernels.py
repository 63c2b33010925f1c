"""Block attention kernels: one call over a block of keys, returning its log-sum-exp.

The ring (gradsched.cp.ring_attention) folds block results together through their LSE, so
it needs kernels that return it, and a backward that takes the merged out and LSE of
the whole row. Which aten kernel runs is a function of the device, the operand dtype
and whether the block needs a mask tensor (`choose_kernel`):

    cpu                          _scaled_dot_product_flash_attention_for_cpu (any dtype, mask)
    cuda, fp16/bf16, no mask,    gradsched.cp.triton_attention: bf16/fp16 operands, fp32 out and
      fp32 accumulation, triton    fp32 dq/dk/dv, so the ring rounds each result once
    cuda, fp16/bf16, no mask     _scaled_dot_product_flash_attention (tensor cores)
    cuda, fp32 or a mask         _scaled_dot_product_efficient_attention

The fp32 accumulation modes ("fp32", "fp32_blocks") pick the Triton kernel where Triton is
installed; GRADSCHED_BLOCK_KERNEL=aten keeps the aten kernels (to compare them). Under
"fp32_blocks" the aten kernels need fp32 operands (`upcast_operands`), the Triton kernel
does not: it runs its precise form on the bf16/fp16 operands.

`is_causal` is used only for square blocks (equal query and key lengths), where every
kernel agrees on what it means (top-left and bottom-right alignment coincide).
"""
from __future__ import annotations

import os

import torch

from gradsched.cp import triton_attention

KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "triton_fp32")
FP32_MODES = ("fp32", "fp32_blocks")
CPU_KV_TILE = 512
"""Keys per tile of the CPU flash kernel (kvSplitSize). Its backward adds each tile's dq
into its output in the input dtype, so past one tile its dq sum rounds more than ours."""


class KernelError(ValueError):
    """No block kernel for this device."""


def triton_enabled(device_type: str) -> bool:
    return (device_type == "cuda" and os.environ.get("GRADSCHED_BLOCK_KERNEL", "") != "aten"
            and triton_attention.available(device_type))


def choose_kernel(device_type: str, dtype: torch.dtype, has_mask: bool,
                  accumulate: str | None = None) -> str:
    """The kernel for a block: see the module docstring. `accumulate`: the ring's mode (None:
    a plain block, results in the operand dtype)."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type in ("cuda", "meta"):  # meta: the dry run (gradsched.dryrun) stands in for a GPU's shapes
        if dtype in (torch.float16, torch.bfloat16) and not has_mask:
            if accumulate in FP32_MODES and triton_enabled(device_type):
                return "triton_fp32"
            return "cuda_flash"
        return "cuda_efficient"
    raise KernelError(f"ring attention has no block kernel for device {device_type!r}: it runs on "
                      "'cpu' and 'cuda'. Move the model to one of them, or keep attention out of "
                      "context parallelism (cp=1).")


def upcast_operands(device_type: str, dtype: torch.dtype, accumulate: str, has_mask: bool = False) -> bool:
    """Whether "fp32_blocks" must hand this kernel fp32 operands to get fp32 results (the aten
    kernels); the Triton kernel gets them from bf16/fp16 operands (it takes no mask)."""
    return accumulate == "fp32_blocks" and dtype != torch.float32 and \
        choose_kernel(device_type, dtype, has_mask, accumulate) != "triton_fp32"


def dq_tile(device_type: str, dtype: torch.dtype) -> int | None:
    """Most keys one backward call should take, so that the kernel's own dq sum (in the
    input dtype) spans no more than one tile; None: the kernel sums dq in fp32."""
    if device_type == "cpu" and torch.finfo(dtype).bits < 32:
        return CPU_KV_TILE
    return None


def _bias(mask, q):
    """An additive mask ([rows, n], or [B or 1, H or 1, rows, n] as the masked ring gives it) as
    the efficient kernel takes it: 4-D, its rows 16-aligned."""
    if mask is None:
        return None
    rows, n = mask.shape[-2:]
    padded = torch.nn.functional.pad(mask, (0, -n % 16))[..., :n]
    return padded.expand(q.shape[0], q.shape[1], rows, n)


def attend(q, k, v, causal: bool, scale: float, mask=None, accumulate: str | None = None):
    """One block: (out, LSE float32 [B, H, Lq]). q, k, v: [B, H, L, D]. out is in q's dtype,
    or float32 from the Triton kernel (`accumulate` "fp32"/"fp32_blocks" on CUDA)."""
    kernel = choose_kernel(q.device.type, q.dtype, mask is not None, accumulate)
    if kernel == "triton_fp32":
        return triton_attention.block_forward(q, k, v, causal, 0, scale,
                                              accumulate == "fp32_blocks")
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


def attend_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None,
                    accumulate: str | None = None):
    """Gradients (dq, dk, dv) of one block, given the merged out and LSE of its rows (float32
    from the Triton kernel)."""
    kernel = choose_kernel(q.device.type, q.dtype, mask is not None, accumulate)
    if kernel == "triton_fp32":
        return triton_attention.block_backward(dout, q, k, v, out, lse, causal, 0, scale,
                                               accumulate == "fp32_blocks")
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
