"""Which block kernel the ring runs (gradsched.attention_kernels), decided without a GPU."""
from __future__ import annotations

import pytest
import torch

from gradsched.attention_kernels import KernelError, choose_kernel, dq_tile
from gradsched.ring_attention import RingAttentionError, check_attention_call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_mask", [False, True])
def test_cpu_blocks_always_run_the_cpu_flash_kernel(dtype, has_mask):
    assert choose_kernel("cpu", dtype, has_mask) == "cpu_flash"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_blocks_without_a_mask_run_flash(dtype):
    assert choose_kernel("cuda", dtype, False) == "cuda_flash"


@pytest.mark.parametrize("dtype, has_mask", [(torch.float32, False), (torch.float32, True),
                                             (torch.bfloat16, True), (torch.float16, True)])
def test_cuda_fp32_or_masked_blocks_run_the_memory_efficient_kernel(dtype, has_mask):
    assert choose_kernel("cuda", dtype, has_mask) == "cuda_efficient"


def test_a_device_without_a_kernel_is_named_in_the_error():
    with pytest.raises(KernelError, match="no block kernel for device 'mps'"):
        choose_kernel("mps", torch.float32, False)


def test_backward_calls_are_limited_to_one_tile_only_where_the_kernel_sums_dq_in_the_input_dtype():
    assert dq_tile("cpu", torch.bfloat16) == 512
    assert dq_tile("cpu", torch.float32) is None
    assert dq_tile("cuda", torch.bfloat16) is None  # flash sums dq in fp32


def test_fewest_roundings_off_the_cpu_is_refused_before_anything_runs():
    args = dict(q_heads=4, kv_heads=4, local_len=8, cp=2, causal=True)
    check_attention_call("attn", **args, fewest_roundings=True, device_type="cpu")
    with pytest.raises(RingAttentionError, match="fewest_roundings=True is for the CPU kernel"):
        check_attention_call("attn", **args, fewest_roundings=True, device_type="cuda")
