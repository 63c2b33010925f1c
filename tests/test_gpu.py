"""On a CUDA device: the ring's block kernels (aten flash for fp16/bf16, memory-efficient
for fp32 and mask tensors) against float64 attention, within the bound of
tests/test_ring_attention.py (what torch's own fused attention achieves on the same
device and inputs). `make gpu-test` runs these; without a GPU they are skipped.

The ring runs simulated (every rank in turn on the one device: the same blocks, merges and
sums as the ring over NCCL, see gradsched.ring_simulation.simulate_ring).
"""
from __future__ import annotations

import pytest
import torch

from gradsched.ring_attention import RingAttentionError
from gradsched.ring_simulation import simulate_ring
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
