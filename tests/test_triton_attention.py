"""The Triton block kernel (gradsched.cp.triton_attention) against attention computed in float64:
under TRITON_INTERPRET=1 on the CPU, or compiled on the GPU where there is one (the same checks;
references and bounds always on the CPU).

In the interpreter `tl.dot` on bf16 blocks is wrong, so these run fp16 operands (bf16 runs
in the GPU suite, tests/test_gpu.py). Bounds: every result within the single-device fp16
kernel's own error (the CPU flash op over the same block: out rounded to fp16, dq/dk/dv
summed in fp16), and with precise=True the fp32 results far below one fp16 rounding of the
exact answer (what "fp32_blocks" promises: nothing is rounded before the ring's final cast).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernel tests need triton (make installs it)")

from gradsched.cp import triton_attention  # noqa: E402

H, D = 2, 32


if triton_attention.available("cpu"):
    DEVICE = "cpu"  # Triton's interpreter
elif torch.cuda.is_available():
    DEVICE = "cuda"  # tests/conftest.py leaves the interpreter off where there is a GPU
else:
    pytest.fail("triton is installed but its interpreter is off on a machine without a GPU: tests/conftest.py "
                "sets TRITON_INTERPRET=1 before triton is first imported; something imported it earlier or set "
                "TRITON_INTERPRET=0", pytrace=False)


def on(*xs):
    return tuple(x.to(DEVICE) for x in xs)


def back(*xs):
    return tuple(x.cpu() for x in xs)


def visible(lq, lk, causal, window):
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        ok &= j <= i + lk - lq
    if window:
        ok &= j > i + lk - lq - window
    return ok


def fp64_block(q, k, v, dout, causal, window):
    """(out, lse, dq, dk, dv) of the block in float64; GQA k/v are read per q-head group."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ ke.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible(q.shape[2], k.shape[2], causal, window), float("-inf"))
    lse = s.logsumexp(-1)
    out = torch.exp(s - lse[..., None]) @ ve
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def single_fp16_kernel(q, k, v, dout, causal, window):
    """(out, dq, dk, dv) of the CPU flash kernel on the same block in fp16: the bound."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    mask = torch.zeros(q.shape[2], k.shape[2], dtype=q.dtype).masked_fill(
        ~visible(q.shape[2], k.shape[2], causal, window), float("-inf"))
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), 0.0, False,
        attn_mask=mask)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def triton_block(q, k, v, dout, causal, window, precise):
    """The kernel as the ring calls it: GQA heads expanded, dk/dv summed back in fp32 (on DEVICE;
    results back on the CPU)."""
    q, k, v, dout = on(q, k, v, dout)
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = triton_attention.block_forward(q, ke, ve, causal, window, scale, precise)
    dq, dk, dv = triton_attention.block_backward(dout, q, ke, ve, out, lse, causal, window, scale,
                                                 precise)
    fold = lambda g: g.view(g.shape[0], k.shape[1], groups, *g.shape[2:]).sum(2)  # noqa: E731
    return back(out, lse, dq, fold(dk), fold(dv))


def block_inputs(lq, lk, kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, H, lq, D, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, kv_heads, lk, D, generator=g).half() for _ in range(2))
    return q, k, v, dout


def mean_err(x, ref):
    """Mean |x - ref|; inf if either holds a NaN or an inf."""
    x, ref = x.double(), ref.double()
    if not (torch.isfinite(x).all() and torch.isfinite(ref).all()):
        return math.inf
    return (x - ref).abs().mean().item()


SHAPES = {"causal-square": (64, 64, True, 0), "causal-bottom-right": (40, 72, True, 0),
          "full": (48, 80, False, 0), "window": (64, 64, True, 20),
          "window-bottom-right": (32, 80, True, 24)}


@pytest.mark.parametrize("precise", [False, True], ids=["fp32", "fp32_blocks"])
@pytest.mark.parametrize("kv_heads", [H, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_block_kernel_is_within_the_fp16_kernels_own_error(shape, kv_heads, precise):
    lq, lk, causal, window = SHAPES[shape]
    q, k, v, dout = block_inputs(lq, lk, kv_heads, seed=len(shape) + kv_heads)
    got = triton_block(q, k, v, dout, causal, window, precise)
    ref = fp64_block(q, k, v, dout, causal, window)
    single = single_fp16_kernel(q, k, v, dout, causal, window)
    assert all(x.dtype == torch.float32 for x in got)
    for name, g, r, s in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (ref[0], *ref[2:]),
                             single):
        assert torch.isfinite(g).all(), name
        assert mean_err(g, r) <= mean_err(s, r), f"{name}: {mean_err(g, r):.3g} > fp16 kernel's " \
                                                 f"{mean_err(s, r):.3g}"
    assert (got[1].double() - ref[1]).abs().max().item() < 1e-5  # LSE, fp32


@pytest.mark.parametrize("shape", ["causal-square", "window"])
def test_precise_results_are_far_below_one_fp16_rounding_of_the_exact_answer(shape):
    lq, lk, causal, window = SHAPES[shape]
    q, k, v, dout = block_inputs(lq, lk, H, seed=7)
    got = triton_block(q, k, v, dout, causal, window, precise=True)
    ref = fp64_block(q, k, v, dout, causal, window)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        rounded_once = mean_err(r.half(), r)
        assert mean_err(g, r) < 0.05 * rounded_once, name


def test_rows_that_see_no_key_get_zeros_and_minus_infinite_lse():
    # Causal with more rows than keys: bottom-right aligned, the first 8 rows see nothing.
    q, k, v, dout = on(*block_inputs(24, 16, H, seed=3))
    out, lse = triton_attention.block_forward(q, k, v, True, 0, D ** -0.5, True)
    assert (out[:, :, :8] == 0).all() and (lse[:, :, :8] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, 8:]).all()
    dq, dk, dv = triton_attention.block_backward(dout, q, k, v, out, lse, True, 0, D ** -0.5, True)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :, :8] == 0).all()


def test_bad_operands_are_refused_with_what_to_do():
    q = torch.randn(1, 2, 16, D, device=DEVICE)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        triton_attention.block_forward(q, q, q, True, 0, 1.0, False)
    q16 = q.half()
    with pytest.raises(ValueError, match="expand GQA heads first"):
        triton_attention.block_forward(q16, q16[:, :1], q16[:, :1], True, 0, 1.0, False)
