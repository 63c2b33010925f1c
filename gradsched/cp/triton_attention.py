"""A Triton block kernel for the ring's fp32 modes: bf16/fp16 operands on tensor cores,
fp32 results.

No released kernel both takes bf16 q, k, v and hands back its block's out in fp32 (unrounded)
with the LSE, and takes the merged fp32 out/LSE back to return dq, dk, dv in fp32. The ring
needs exactly that: every block result it folds is then rounded once, at the end.

    block_forward(q, k, v, causal, window, scale, precise) -> (out fp32, lse fp32 [B, H, Lq])
    block_backward(dout, q, k, v, out, lse, causal, window, scale, precise) -> dq, dk, dv fp32

q, k, v: [B, H, L, D], same heads (the ring expands GQA heads before the call), fp16 or bf16.
`causal` is aligned to the bottom right (key j is seen by row i when j <= i + Lk - Lq);
`window` > 0 also hides keys j <= i + Lk - Lq - window (the HF sliding-window convention).
A row that sees no key gets out 0 and LSE -inf.

Every product of two operands is exact in fp32, so the only roundings inside are the
probabilities P (forward: P @ V) and dS (backward: dS @ K, dS^T @ Q), which the tensor cores
take in the operand dtype. `precise=True` removes them too: a fp32 value x is fed as
hi = x.to(bf16) plus lo = (x - hi).to(bf16), two tensor-core products that together carry 16
bits of mantissa, about fp32's accuracy for a probability (lo is scaled by 2^11 before its
cast and back after the product, so that fp16's narrow range does not flush it to zero). That doubles the P @ V and dS
products (forward about 1.5x the products, backward about 1.6x) and is what
accumulate="fp32_blocks" runs, the rounding floor at bf16 speed; accumulate="fp32" runs
precise=False.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors; it must be set before triton is first
imported (tests/conftest.py does). In the interpreter `tl.dot` on bf16 blocks is wrong (seen
with triton 3.9): test with fp16 there.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    jit = triton.jit
except ImportError:  # an optional GPU extra
    triton = tl = None
    jit = lambda fn: fn  # noqa: E731  (the kernels are then never launched)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
DTYPES = (torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device_type: str) -> bool:
    """Triton is installed and can run here: on CUDA, or on the CPU under the interpreter."""
    return triton is not None and (device_type == "cuda" or (device_type == "cpu" and interpreting()))


LO_SCALE = 2048.0  # 2^11: exact, keeps the low part of a split out of fp16's subnormals


# ---- kernels ----------------------------------------------------------------------------------

@jit
def _visible(rows, cols, Lq, Lk, offset, window, CAUSAL, WINDOWED):
    ok = (rows[:, None] < Lq) & (cols[None, :] < Lk)
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + offset)
    if WINDOWED:
        ok = ok & (cols[None, :] > rows[:, None] + offset - window)
    return ok


@jit
def _low(x, hi):
    """The part of fp32 `x` that its cast `hi` dropped, scaled by LO_SCALE, in hi's dtype."""
    return ((x - hi.to(tl.float32)) * 2048.0).to(hi.dtype)


@jit
def _delta(O, DO, DELTA, Lq, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row sums of dO * O in fp32 (the softmax backward's correction), one row block."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < Lq) & (d[None, :] < D)
    at = bh * Lq * D + rows[:, None] * D + d[None, :]
    o = tl.load(O + at, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * Lq + rows, tl.sum(o * do, 1), mask=rows < Lq)


@jit
def _fwd(Q, K, V, O, LSE, Lq, Lk, offset, window, qk_scale: tl.constexpr,
         CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, SPLIT: tl.constexpr,
         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    Q += bh * Lq * D
    K += bh * Lk * D
    V += bh * Lk * D
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=(rows[:, None] < Lq) & (d[None, :] < D),
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = 0
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M + offset)
    if WINDOWED:
        lo = tl.maximum(0, start_m + offset - window + 1) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < Lk) & (d[None, :] < D)
        k = tl.load(K + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(_visible(rows, cols, Lq, Lk, offset, window, CAUSAL, WINDOWED), s,
                     float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        p_hi = p.to(v.dtype)
        acc = tl.dot(p_hi, v, acc)
        if SPLIT:
            acc += tl.dot(_low(p, p_hi), v) * (1.0 / 2048.0)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    O += bh * Lq * D
    tl.store(O + rows[:, None] * D + d[None, :], out, mask=(rows[:, None] < Lq) & (d[None, :] < D))
    tl.store(LSE + bh * Lq + rows, lse, mask=rows < Lq)


@jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, Lq, Lk, offset, window, qk_scale: tl.constexpr,
              sm_scale: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, SPLIT: tl.constexpr,
              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    Q += bh * Lq * D
    DO += bh * Lq * D
    K += bh * Lk * D
    V += bh * Lk * D
    LSE += bh * Lq
    DELTA += bh * Lq
    kv_mask = (cols[:, None] < Lk) & (d[None, :] < D)
    k = tl.load(K + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    hi = Lq
    if CAUSAL:
        lo = tl.maximum(0, start_n - offset) // BLOCK_M * BLOCK_M
    if WINDOWED:
        hi = tl.minimum(Lq, start_n + BLOCK_N - offset + window)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_mask = (rows[:, None] < Lq) & (d[None, :] < D)
        q = tl.load(Q + rows[:, None] * D + d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + rows[:, None] * D + d[None, :], mask=q_mask, other=0.0)
        lse2 = tl.load(LSE + rows, mask=rows < Lq, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + rows, mask=rows < Lq, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.where(_visible(rows, cols, Lq, Lk, offset, window, CAUSAL, WINDOWED),
                     tl.exp2(s - lse2[:, None]), 0.0)
        p_hi = p.to(q.dtype)
        dv += tl.dot(tl.trans(p_hi), do)
        if SPLIT:
            dv += tl.dot(tl.trans(_low(p, p_hi)), do) * (1.0 / 2048.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        ds_hi = ds.to(q.dtype)
        dk += tl.dot(tl.trans(ds_hi), q)
        if SPLIT:
            dk += tl.dot(tl.trans(_low(ds, ds_hi)), q) * (1.0 / 2048.0)
    DK += bh * Lk * D
    DV += bh * Lk * D
    tl.store(DK + cols[:, None] * D + d[None, :], dk * sm_scale, mask=kv_mask)
    tl.store(DV + cols[:, None] * D + d[None, :], dv, mask=kv_mask)


@jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, Lq, Lk, offset, window, qk_scale: tl.constexpr,
            sm_scale: tl.constexpr,
            CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, SPLIT: tl.constexpr,
            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    Q += bh * Lq * D
    DO += bh * Lq * D
    K += bh * Lk * D
    V += bh * Lk * D
    q_mask = (rows[:, None] < Lq) & (d[None, :] < D)
    q = tl.load(Q + rows[:, None] * D + d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * D + d[None, :], mask=q_mask, other=0.0)
    lse2 = tl.load(LSE + bh * Lq + rows, mask=rows < Lq, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * Lq + rows, mask=rows < Lq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = 0
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(Lk, start_m + BLOCK_M + offset)
    if WINDOWED:
        lo = tl.maximum(0, start_m + offset - window + 1) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < Lk) & (d[None, :] < D)
        k = tl.load(K + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.where(_visible(rows, cols, Lq, Lk, offset, window, CAUSAL, WINDOWED),
                     tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        ds_hi = ds.to(k.dtype)
        dq += tl.dot(ds_hi, k)
        if SPLIT:
            dq += tl.dot(_low(ds, ds_hi), k) * (1.0 / 2048.0)
    DQ += bh * Lq * D
    tl.store(DQ + rows[:, None] * D + d[None, :], dq * sm_scale, mask=q_mask)


# ---- launch ---------------------------------------------------------------------------------

# Tiles per kernel and head dim (<= 64, larger): (BLOCK_M rows, BLOCK_N keys, warps, stages).
# dkdv holds BLOCK_N keys and loops over rows; fwd and dq hold BLOCK_M rows and loop over keys.
# benchmarks/triton_kernel.py --sweep times candidates and rejects any whose results are wrong:
# on an H100 with triton 3.6, dkdv with 128-key tiles and 8 warps returned wrong dk (3% mean
# relative error) where precise=False, so dkdv stays at 64 x 64.
# The choices below are that sweep's (benchmarks/results/triton_kernel_sweep_h100.jsonl).
CONFIGS = {
    ("fwd", True): (64, 64, 4, 3), ("fwd", False): (64, 64, 4, 3),
    ("dkdv", True): (64, 64, 4, 3), ("dkdv", False): (64, 64, 4, 3),
    ("dq", True): (64, 64, 4, 3), ("dq", False): (128, 64, 8, 3),
}


def _config(head_dim: int, kernel: str) -> dict:
    """Tile sizes: small tiles under the interpreter (it runs a tile per Python step)."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16)
    m, n, warps, stages = CONFIGS[(kernel, head_dim <= 64)]
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)


def _check(q, k, v, window: int):
    if triton is None:
        raise RuntimeError("the Triton block kernel needs triton (pip install triton)")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the Triton block kernel takes fp16 or bf16 q, k, v of one dtype; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[:2] != k.shape[:2] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"the Triton block kernel takes q [B, H, Lq, D] and k, v [B, H, Lk, D] "
                         f"with the same B, H, D; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)} (expand GQA heads first)")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")


def _scalars(q, k, causal: bool, window: int, scale: float) -> dict:
    d = q.shape[-1]
    return dict(Lq=q.shape[2], Lk=k.shape[2], offset=k.shape[2] - q.shape[2], window=window,
                CAUSAL=causal, WINDOWED=window > 0, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)))


def _launch(kernel, grid, *args, **kw):
    if interpreting():
        return kernel[grid](*args, **kw)
    from torch.library import wrap_triton  # traceable by torch.compile
    return wrap_triton(kernel)[grid](*args, **kw)


def block_forward(q, k, v, causal: bool, window: int, scale: float, precise: bool):
    """(out fp32 [B, H, Lq, D], LSE fp32 [B, H, Lq]) of one block; see the module docstring."""
    _check(q, k, v, window)
    if interpreting():
        return _forward(q, k, v, causal, window, scale, precise)
    return torch.ops.gradsched.triton_block_forward(q, k, v, causal, window, scale, precise)


def block_backward(dout, q, k, v, out, lse, causal: bool, window: int, scale: float,
                   precise: bool):
    """(dq, dk, dv) in fp32 of one block, given the merged out and LSE of its rows (any float
    dtype; the row sums dO.O are taken in fp32). dout is taken in q's dtype (the gradient the
    model hands the attention, exact there)."""
    _check(q, k, v, window)
    dout = dout.to(q.dtype)
    if interpreting():
        return _backward(dout, q, k, v, out, lse, causal, window, scale, precise)
    return torch.ops.gradsched.triton_block_backward(dout, q, k, v, out, lse, causal, window,
                                                     scale, precise)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
             scale: float, precise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (x.contiguous() for x in (q, k, v))
    b, h, lq, _ = q.shape
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    cfg = _config(q.shape[-1], "fwd")
    grid = (triton.cdiv(lq, cfg["BLOCK_M"]), b * h)
    _launch(_fwd, grid, q, k, v, out, lse, qk_scale=scale * LOG2E, SPLIT=precise,
            **_scalars(q, k, causal, window, scale), **cfg)
    return out, lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, causal: bool, window: int, scale: float,
              precise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (x.contiguous() for x in (q, k, v))
    dout = dout.contiguous()
    out, lse = out.contiguous(), lse.float().contiguous()
    b, h, lq, d = q.shape
    delta = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    sc = _scalars(q, k, causal, window, scale)
    _launch(_delta, (triton.cdiv(lq, 64), b * h), out, dout, delta, lq, D=d,
            BLOCK_D=sc["BLOCK_D"], BLOCK_M=64)
    cfg = _config(d, "dkdv")
    _launch(_bwd_dkdv, (triton.cdiv(k.shape[2], cfg["BLOCK_N"]), b * h), q, k, v, dout, lse, delta,
            dk, dv, qk_scale=scale * LOG2E, sm_scale=scale, SPLIT=precise, **sc, **cfg)
    cfg = _config(d, "dq")
    _launch(_bwd_dq, (triton.cdiv(lq, cfg["BLOCK_M"]), b * h), q, k, v, dout, lse, delta, dq,
            qk_scale=scale * LOG2E, sm_scale=scale, SPLIT=precise, **sc, **cfg)
    return dq, dk, dv


if triton is not None:
    # Custom ops, so that torch.compile traces a block call as one node (Inductor compiles
    # the Triton kernels inside it) and FakeTensor runs give the outputs' shapes.
    torch.library.triton_op("gradsched::triton_block_forward", _forward, mutates_args=())
    torch.library.triton_op("gradsched::triton_block_backward", _backward, mutates_args=())
