"""Which block kernel the ring runs (gradsched.cp.attention_kernels), decided without a GPU."""
from __future__ import annotations

import pytest
import torch

from gradsched.cp import attention_kernels
from gradsched.cp.attention_kernels import KernelError, choose_kernel, dq_tile, upcast_operands
from gradsched.cp.ring_attention import RingAttentionError, check_attention_call


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


@pytest.mark.parametrize("accumulate", ["fp32", "fp32_blocks"])
def test_cuda_fp32_accumulation_of_reduced_operands_runs_the_triton_kernel(monkeypatch, accumulate):
    monkeypatch.setattr(attention_kernels.triton_attention, "available", lambda device: True)
    assert choose_kernel("cuda", torch.bfloat16, False, accumulate) == "triton_fp32"
    assert not upcast_operands("cuda", torch.bfloat16, accumulate)  # it returns fp32 itself


def test_the_triton_kernel_is_not_chosen_where_it_does_not_apply(monkeypatch):
    monkeypatch.setattr(attention_kernels.triton_attention, "available", lambda device: True)
    assert choose_kernel("cuda", torch.bfloat16, False, "input") == "cuda_flash"
    assert choose_kernel("cuda", torch.bfloat16, False, None) == "cuda_flash"
    assert choose_kernel("cuda", torch.bfloat16, True, "fp32") == "cuda_efficient"  # a mask
    assert choose_kernel("cuda", torch.float32, False, "fp32") == "cuda_efficient"
    assert choose_kernel("cpu", torch.bfloat16, False, "fp32") == "cpu_flash"
    monkeypatch.setenv("GRADSCHED_BLOCK_KERNEL", "aten")
    assert choose_kernel("cuda", torch.bfloat16, False, "fp32") == "cuda_flash"


def test_without_triton_cuda_fp32_blocks_upcasts_for_the_aten_kernel(monkeypatch):
    monkeypatch.setattr(attention_kernels.triton_attention, "available", lambda device: False)
    assert choose_kernel("cuda", torch.bfloat16, False, "fp32_blocks") == "cuda_flash"
    assert upcast_operands("cuda", torch.bfloat16, "fp32_blocks")
    assert upcast_operands("cpu", torch.bfloat16, "fp32_blocks")
    assert not upcast_operands("cpu", torch.bfloat16, "fp32")


def test_masked_cuda_blocks_in_fp32_modes_get_fp32_operands_even_where_triton_runs(monkeypatch):
    # the Triton kernel takes no mask: a masked block runs the efficient kernel, which returns its operands' dtype
    monkeypatch.setattr(attention_kernels.triton_attention, "available", lambda device: True)
    assert upcast_operands("cuda", torch.bfloat16, "fp32_blocks", has_mask=True)
    assert not upcast_operands("cuda", torch.bfloat16, "fp32_blocks", has_mask=False)


@pytest.mark.parametrize("shape", [(8, 20), (2, 1, 8, 20)], ids=["2-D", "per batch row"])
def test_a_mask_reaches_the_efficient_kernel_as_one_bias_per_head_with_aligned_rows(shape):
    # the masked ring hands a mask per batch row ([B, 1, rows, keys]); a 2-D one is shared by the batch
    mask = torch.randn(shape)
    q = torch.empty(2, 3, 8, 4)
    bias = attention_kernels._bias(mask, q)
    assert bias.shape == (2, 3, 8, 20)
    assert torch.equal(bias, mask.expand(2, 3, 8, 20))
    assert bias.stride(-2) % 16 == 0 and bias.stride(-1) == 1
