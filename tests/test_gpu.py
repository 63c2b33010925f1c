"""On a CUDA device: the ring's block kernels (aten flash for fp16/bf16, memory-efficient
for fp32 and mask tensors) against float64 attention, within the bound of
tests/test_ring_attention.py (what torch's own fused attention achieves on the same
device and inputs). `make gpu-test` runs these; without a GPU they are skipped.

The ring runs simulated (every rank in turn on the one device: the same blocks, merges and
sums as the ring over NCCL, see gradsched.cp.ring_simulation.simulate_ring).
"""
from __future__ import annotations

import math

import pytest
import torch

from gradsched.cp.ring_attention import RingAttentionError
from gradsched.cp.ring_simulation import simulate_ring
from tests.test_ring_attention import check_accuracy, fp64_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the GPU suite runs on a machine with one "
                                        "(make gpu-test)")]


def torch_fused(q, k, v, causal, grad_out):
    """(out, dq, dk, dv) of torch's own fused SDPA on the whole sequence (flash for fp16/bf16,
    memory-efficient for fp32): the single-device baseline."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    backend = SDPBackend.EFFICIENT_ATTENTION if q.dtype == torch.float32 else \
        SDPBackend.FLASH_ATTENTION
    groups = q.shape[1] // k.shape[1]
    with sdpa_kernel([backend]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=causal)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def cuda_inputs(dtype, kv_heads, seq, seed, heads=8, dim=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, h, seq, dim, generator=g, device="cuda").to(dtype)
            for h in (heads, kv_heads, kv_heads, heads)]


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_simulated_ring_on_cuda_matches_fp64_within_the_fused_kernel_bound(
        cp, dtype, causal, kv_heads):
    q, k, v, dout = cuda_inputs(dtype, kv_heads, seq=1024, seed=cp)
    got = simulate_ring(q, k, v, cp, causal, grad_out=dout)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (got.out, got.lse, got.dq, got.dk, got.dv)):
        assert x.device.type == "cuda" and torch.isfinite(x).all(), name
    failures = check_accuracy((got.out, got.dq, got.dk, got.dv),
                              torch_fused(q, k, v, causal, dout),
                              fp64_attention(q, k, v, causal, dout), dtype, cp)
    assert not failures, "\n".join(failures)


def test_fewest_roundings_is_refused_on_cuda():
    # Its mask tensors run the memory-efficient kernel, whose bf16/fp16 dq/dk were wrong here.
    q, k, v, dout = cuda_inputs(torch.bfloat16, 8, seq=256, seed=0)
    with pytest.raises(RingAttentionError, match="fewest_roundings=True is for the CPU kernel"):
        simulate_ring(q, k, v, 2, True, grad_out=dout, fewest_roundings=True)


@pytest.mark.parametrize("accumulate", ["fp32_blocks", "input"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_simulated_ring_other_accumulation_modes_on_cuda(accumulate, causal):
    q, k, v, dout = cuda_inputs(torch.bfloat16, 2, seq=1024, seed=11)
    got = simulate_ring(q, k, v, 4, causal, accumulate, grad_out=dout)
    # "input" rounds to bf16 at every step: only the max bound is promised (as on CPU)
    failures = check_accuracy((got.out, got.dq, got.dk, got.dv),
                              torch_fused(q, k, v, causal, dout),
                              fp64_attention(q, k, v, causal, dout), torch.bfloat16, 4,
                              mean_factor=None if accumulate == "input" else 1.5)
    assert not failures, "\n".join(failures)


def test_fp32_ring_with_the_aten_kernels_still_meets_the_bound(monkeypatch):
    monkeypatch.setenv("GRADSCHED_BLOCK_KERNEL", "aten")  # the path without Triton
    q, k, v, dout = cuda_inputs(torch.bfloat16, 2, seq=1024, seed=12)
    got = simulate_ring(q, k, v, 4, True, grad_out=dout)
    failures = check_accuracy((got.out, got.dq, got.dk, got.dv),
                              torch_fused(q, k, v, True, dout),
                              fp64_attention(q, k, v, True, dout), torch.bfloat16, 4)
    assert not failures, "\n".join(failures)


# ---- the Triton block kernel on the GPU (bf16 too: the interpreter only checks fp16) --------

def _mean_err(x, ref):
    """Mean |x - ref|; inf if either holds a NaN or an inf."""
    x, ref = x.double(), ref.double()
    if not (torch.isfinite(x).all() and torch.isfinite(ref).all()):
        return math.inf
    return (x - ref).abs().mean().item()


@pytest.mark.parametrize("precise", [False, True], ids=["fp32", "fp32_blocks"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_block_kernel_beats_the_flash_kernels_own_error(dtype, causal, precise):
    from gradsched.cp import triton_attention
    from gradsched.cp.attention_kernels import attend, attend_backward

    q, k, v, dout = cuda_inputs(dtype, 8, seq=1024, seed=13, dim=128)
    scale = 128 ** -0.5
    out, lse = triton_attention.block_forward(q, k, v, causal, 0, scale, precise)
    got = (out, *triton_attention.block_backward(dout, q, k, v, out, lse, causal, 0, scale,
                                                 precise))
    f_out, f_lse = attend(q, k, v, causal, scale)  # aten flash, results in the input dtype
    flash = (f_out, *attend_backward(dout, q, k, v, f_out, f_lse, causal, scale))
    ref = fp64_attention(q, k, v, causal, dout)
    for name, g, f, r in zip(("out", "dq", "dk", "dv"), got, flash, ref):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        assert _mean_err(g, r) <= _mean_err(f, r), name
        if precise:  # the rounding floor: far below one rounding of the exact answer
            assert _mean_err(g, r) < 0.05 * _mean_err(r.to(dtype), r), name


def test_triton_block_kernel_compiles_inside_torch_compile():
    from gradsched.cp import triton_attention

    q, k, v, dout = cuda_inputs(torch.bfloat16, 8, seq=512, seed=14)

    def block(q, k, v):
        out, lse = triton_attention.block_forward(q, k, v, True, 0, 0.125, True)
        return out * 2, lse

    eager = block(q, k, v)
    compiled = torch.compile(block, fullgraph=True)(q, k, v)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
