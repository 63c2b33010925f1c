"""How accurate is ring attention, per accumulation mode, against one device and fp64?

    python benchmarks/cp_numerics.py --cp 8 --seq 4096 --heads 12 --dim 128 --dtype bf16 --causal

Starts --cp gloo processes (gradsched.launch.run_ranks), runs the ring forward and
backward once per accumulation mode on the same inputs, and prints one JSON object per
(mode, tensor) on stdout, also written to benchmarks/results/cp_numerics.jsonl:

    mean_abs_err, max_abs_err   the ring against attention in float64 over the whole sequence
    single_mean_abs_err         the same kernel in one process over the whole sequence, same dtype
    ratio_to_single             mean_abs_err / single_mean_abs_err
    mismatch_vs_single          fraction of elements outside rtol=1.3e-6, atol=1e-5 of the
                                single-process result (TransformerEngine PR #821's metric)

Targets (accumulate="fp32"): out ratio <= 1.15 and dq/dk/dv ratios <= 0.95;
("fp32_blocks"): out ratio <= 0.70. Every mode runs the ring's default schedule, which on the
CPU kernel at cp > 4 is fewest_roundings: a row chunk's calls of a window are joined, its diagonal
block as a mask, so each row's output is rounded to the input dtype fewer times (slower: masked
blocks are computed); at cp <= 4 the fast schedule rounds a row's output at most twice and is the
default. The mode "fp32+fast_schedule" is accumulate="fp32" with fewest_roundings=False (no masks,
the default on CUDA), to show what the fast schedule costs in accuracy here.
The extra mode "torch_ring" runs torch's own ring
(`_templated_ring_attention` and `_templated_ring_attention_backward`, the engine of
torch.distributed.tensor.experimental.context_parallel) with its default options
(fp32 merge and gradient sums, head-tail load balancing, all-gather K/V rotation) on
the CPU flash op and the same shards, for comparison. Progress goes to stderr. The fp64 reference and the
single-process run are computed once, in this process, before the ranks start; each
rank builds the inputs itself from the seed.

--mask window|document|padding (cpu only) measures the masked ring instead, simulated in this
process by gradsched.cp.ring_simulation.simulate_ring (every rank in turn, bit for bit the ring with
comm="ring"; modes fp32, input, fp32_blocks, fp32+fast_schedule, torch's ring takes no masks).
Masks are sized from --seq: a causal window of seq // 8 tokens (--window), five packed documents of
pseudo-random lengths from the seed (position ids restarting at 0), or padded keys (even batch rows
left-padded by seq // 7, their first queries see nothing; odd rows, or a batch of one,
right-padded by seq // 5). The fp64 reference builds its bool mask here from the HF conventions,
independently of gradsched.masks; the single device is the same CPU flash kernel with that mask
as an additive 0/-inf mask. The statistics leave out what is zero everywhere by the mask's
definition (queries that see nothing, keys nobody sees; left_out_max_abs: the ring's largest value
there, 0 expected), and add floor_mean_abs_err, the error of rounding the fp64 answer once to
--dtype (the rounding floor), with ratio_to_floor. Targets (the masking issue's): fp32
ratio_to_single <= 1.0, fp32_blocks ratio_to_floor <= 1.02, per tensor: each such row gets
meets_target. Masked rows are appended to the results file; every row has "mask" (null: none).
Document rows report the attention work per rank (visible query-key pairs, gradsched.cp.balance) and
its imbalance (busiest over mean) in both layouts: the head-tail one and load_balance="documents"
(each document cut into pieces over all ranks); --load-balance documents runs the numerics in the
latter (the sequence reordered, the documents handed over as seq_idx, results put back in order).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from gradsched.cp.layout import shard, unshard
from gradsched.launch import run_ranks
from gradsched.cp.ring_attention import ACCUMULATE_MODES, ring_attention
from common import emit  # benchmarks/common.py (the script's folder is on sys.path)

FAST = "fp32+fast_schedule"  # accumulate="fp32", fewest_roundings=False: no masked calls, more bf16 roundings
FEWEST = "fp32+fewest_roundings"  # accumulate="fp32", fewest_roundings=True (the CPU default at cp > 4)
SCHEDULES = {FAST: False, FEWEST: True}  # modes that set the schedule; the others take the default
MODES = (*ACCUMULATE_MODES, FAST, "torch_ring")  # run by default; FEWEST on request (--modes)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TENSORS = ("out", "dq", "dk", "dv")
MASKS = ("window", "document", "padding")
MASK_MODES = (*ACCUMULATE_MODES, FAST)  # torch's ring takes no masks
TARGETS = {"fp32": ("ratio_to_single", 1.0), "fp32_blocks": ("ratio_to_floor", 1.02)}  # masked runs
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cp_numerics.jsonl")


def log(msg: str) -> None:
    print(f"[cp_numerics {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_inputs(cfg: dict):
    g = torch.Generator().manual_seed(cfg["seed"])
    dtype = DTYPES[cfg["dtype"]]
    shape = lambda h: (cfg["batch"], h, cfg["seq"], cfg["dim"])  # noqa: E731
    return [torch.randn(shape(h), generator=g).to(dtype)
            for h in (cfg["heads"], cfg["kv_heads"], cfg["kv_heads"], cfg["heads"])]


def mask_args(cfg: dict) -> tuple[dict, dict]:
    """(simulate_ring's mask arguments, what they are for the results row) for cfg["mask"],
    sized from the sequence so that they mean the same at any length."""
    seq, batch = cfg["seq"], cfg["batch"]
    if cfg["mask"] == "window":
        window = cfg["window"] or seq // 8
        return {"window": window}, {"window": window}
    if cfg["mask"] == "document":  # 4 cuts drawn from the seed: 5 documents of unequal lengths
        g = torch.Generator().manual_seed(cfg["seed"])
        cuts = sorted((torch.randperm(seq - 1, generator=g)[:4] + 1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
        return ({"position_ids": torch.cat([torch.arange(n) for n in lengths])[None]},
                {"doc_lengths": lengths})
    keep = torch.ones(batch, seq, dtype=torch.bool)
    pads = []
    for b in range(batch):  # left padding leaves queries that see nothing (causal): the edge case
        left, right = (0, seq // 5) if b % 2 or batch == 1 else (seq // 7, 0)
        keep[b, :left] = False
        keep[b, seq - right:] = False
        pads.append([left, right])
    return {"key_padding": keep}, {"padding_left_right": pads}


def visibility(cfg: dict, window=None, position_ids=None, key_padding=None) -> torch.Tensor:
    """bool [B, S, S]: may query i see key j. Written from the HF conventions, not with
    gradsched.masks, so that the reference shares no mask code with the ring."""
    seq = cfg["seq"]
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    m = torch.ones(1, seq, seq, dtype=torch.bool)
    if cfg["causal"]:
        m = m & (j <= i)
    if window is not None:
        m = m & (i - j < window)
    if position_ids is not None:  # a new document wherever the position does not step by +1
        doc = torch.nn.functional.pad((position_ids[:, 1:] != position_ids[:, :-1] + 1).cumsum(1), (1, 0))
        m = m & (doc[:, :, None] == doc[:, None, :])
    if key_padding is not None:
        m = m & key_padding[:, None, :]
    return m.expand(cfg["batch"], seq, seq)


def fp64_reference(q, k, v, dout, causal: bool, visible=None):
    """out, dq, dk, dv of softmax attention in float64, one (batch, kv head) at a time.
    visible: bool [B, S, S] instead of causal; queries that see nothing get zeros."""
    groups = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    n = q.shape[2]
    f64 = dict(dtype=torch.float64, device=q.device)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if causal else None
    out, dq = torch.empty(q.shape, **f64), torch.empty(q.shape, **f64)
    dk, dv = torch.empty(k.shape, **f64), torch.empty(v.shape, **f64)
    for b in range(q.shape[0]):
        for h in range(k.shape[1]):
            heads = slice(h * groups, (h + 1) * groups)
            qh = q[b, heads].double().requires_grad_()
            kh, vh = (x[b, h].double().requires_grad_() for x in (k, v))
            scores = qh @ kh.T * scale
            if visible is not None:  # a row with no key: nan from softmax, zeros in the answer
                probs = scores.masked_fill(~visible[b], float("-inf")).softmax(-1).nan_to_num(0.0)
            else:
                if mask is not None:
                    scores = scores.masked_fill(mask, float("-inf"))
                probs = scores.softmax(-1)
            oh = probs @ vh
            oh.backward(dout[b, heads].double())
            out[b, heads], dq[b, heads], dk[b, h], dv[b, h] = oh.detach(), qh.grad, kh.grad, vh.grad
    return out, dq, dk, dv


def single_process(q, k, v, dout, causal: bool, visible=None):
    """out, dq, dk, dv of the CPU flash kernel over the whole sequence, in the input dtype.
    visible: bool [B, S, S], passed as an additive 0/-inf mask instead of causal."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    extra = {}
    if visible is not None:
        causal = False
        extra["attn_mask"] = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))[:, None]
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), 0.0, causal, **extra)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def single_cuda(q, k, v, dout, causal: bool):
    """out, dq, dk, dv of torch's fused SDPA on one GPU over the whole sequence (flash for
    bf16/fp16), in the input dtype: the single-device baseline on CUDA."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


CUDA_MODES = ("fp32", "fp32_blocks", "input", "fp32+aten", "fp32_blocks+aten")


def simulated_on_cuda(q, k, v, dout, cfg: dict, cp: int) -> dict:
    """{mode: ((out, dq, dk, dv), seconds)} of the ring simulated on one GPU (every rank in
    turn: the ring's blocks, merges and sums). "+aten" keeps the aten kernels (flash for the
    fp32 merge; fp32 operands through the memory-efficient kernel for fp32_blocks) where the
    plain modes run the Triton kernel."""
    from gradsched.cp.ring_simulation import simulate_ring

    results = {}
    for mode in cfg["modes"]:
        accumulate, _, kernel = mode.partition("+")
        os.environ["GRADSCHED_BLOCK_KERNEL"] = kernel
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = simulate_ring(q, k, v, cp, cfg["causal"], accumulate, grad_out=dout)
        torch.cuda.synchronize()
        results[mode] = ((got.out, got.dq, got.dk, got.dv), time.perf_counter() - t0)
        log(f"simulated ring, accumulate={mode}: {results[mode][1]:.2f} s")
    os.environ.pop("GRADSCHED_BLOCK_KERNEL", None)
    return results


def simulated_masked(q, k, v, dout, cfg: dict, cp: int, masks: dict) -> dict:
    """{mode: ((out, dq, dk, dv), seconds)} of the masked ring simulated in this process, every
    rank in turn (seconds: all ranks together). Under load_balance="documents" the sequence is
    reordered first (gradsched.cp.layout.document_order) and the results put back."""
    from gradsched.cp.ring_simulation import simulate_ring

    back = None
    if cfg.get("load_balance") == "documents":
        from gradsched.cp.layout import document_order
        from gradsched.masks import document_ids
        order = document_order(masks["position_ids"], cp)[0]
        q, k, v, dout = (x.index_select(2, order) for x in (q, k, v, dout))
        masks = {"seq_idx": document_ids(masks["position_ids"]).index_select(1, order)}
        back = torch.argsort(order)
    results = {}
    for mode in cfg["modes"]:
        t0 = time.perf_counter()
        got = simulate_ring(q, k, v, cp, cfg["causal"], mode.split("+")[0], grad_out=dout,
                            fewest_roundings=SCHEDULES.get(mode), **masks)
        tensors = (got.out, got.dq, got.dk, got.dv)
        if back is not None:
            tensors = tuple(x.index_select(2, back) for x in tensors)
        results[mode] = (tensors, time.perf_counter() - t0)
        log(f"simulated masked ring, accumulate={mode}: {results[mode][1]:.1f} s")
    return results


def torch_ring_attention(q, k, v, dout, causal: bool, group=None):
    """(out, dq, dk, dv) of torch's ring attention on this rank's shards (head-tail layout,
    which is gradsched.cp.layout's balanced layout), with the CPU flash op.

    Torch's default options; its load balancing is switched off for non-causal
    attention only, where it refuses to run (and where the layout does not matter).
    K/V heads are repeated for GQA (torch's ring has no GQA) and their grads summed.
    """
    from torch.distributed.tensor.experimental._context_parallel import _attention as tcp

    group = group or dist.group.WORLD
    aten = torch.ops.aten
    groups = q.shape[1] // k.shape[1]
    ke, ve = (x.repeat_interleave(groups, 1) for x in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    balance = tcp._cp_options.enable_load_balance
    tcp._cp_options.enable_load_balance = balance and causal
    try:
        out, lse = tcp._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, ke, ve,
            is_causal=causal, dropout_p=0.0, scale=scale)
        dq, dk, dv = tcp._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward, dout, "grad_out",
            q, ke, ve, out, lse, is_causal=causal, dropout_p=0.0, scale=scale)[:3]
    finally:
        tcp._cp_options.enable_load_balance = balance
    if groups > 1:
        dk, dv = (g.unflatten(1, (k.shape[1], groups)).sum(2) for g in (dk, dv))
    return out, dq, dk, dv


def _rank(rank: int, world: int, cfg: dict):
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    q, k, v, dout = (shard(x, world, rank, dim=2) for x in make_inputs(cfg))
    results = {}
    for mode in cfg["modes"]:
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        t0 = time.perf_counter()
        if mode == "torch_ring":
            got = torch_ring_attention(q, k, v, dout, cfg["causal"])
        else:
            out = ring_attention(ql, kl, vl, group, causal=cfg["causal"], accumulate=mode.split("+")[0],
                                 comm=cfg["comm"], fewest_roundings=SCHEDULES.get(mode))
            out.backward(dout)
            got = (out.detach(), ql.grad, kl.grad, vl.grad)
        seconds = time.perf_counter() - t0
        if rank == 0:
            log(f"rank 0: accumulate={mode} forward+backward {seconds:.1f} s")
        results[mode] = (got, seconds)
    return results


def abs_err(x, ref) -> torch.Tensor:
    """|x - ref| in fp64, element by element, inf where either side is a NaN or an inf: a mean or max
    of it is then inf, and a NaN or inf reads as a failure."""
    x, ref = x.double(), ref.double()
    return torch.where(torch.isfinite(x) & torch.isfinite(ref), (x - ref).abs(), math.inf)


def error_ratio(err: float, base: float) -> float:
    """err / base; inf if either is inf (a non-finite baseline would otherwise make any error look small)."""
    return math.inf if math.inf in (err, base) else err / base if base else float("nan")


def metrics(ring, single, ref) -> dict:
    err = abs_err(ring, ref)
    single_mean = abs_err(single, ref).mean().item()
    mismatch = ~torch.isclose(ring.double(), single.double(), rtol=1.3e-6, atol=1e-5)
    return {"mean_abs_err": err.mean().item(), "max_abs_err": err.max().item(),
            "single_mean_abs_err": single_mean,
            "ratio_to_single": error_ratio(err.mean().item(), single_mean),
            "mismatch_vs_single": mismatch.double().mean().item()}


def masked_metrics(ring, single, ref, seen, dtype) -> dict:
    """metrics over the tokens seen (seen: [B, S], queries that see a key or keys that a query
    sees; the rest is zero by definition and would only dilute the means), the rounding floor,
    and the ring's largest value among the tokens left out (0 expected)."""
    keep = seen[:, None, :, None].expand(ring.shape)
    exact = ref[keep]
    floor = abs_err(exact.to(dtype), exact).mean().item()
    row = metrics(ring[keep], single[keep], exact)
    left_out = ring[~keep]
    return {**row, "floor_mean_abs_err": floor,
            "ratio_to_floor": error_ratio(row["mean_abs_err"], floor),
            "left_out_fraction": left_out.numel() / ring.numel(),
            "left_out_max_abs": left_out.abs().max().item() if left_out.numel() else 0.0}


def target_check(row: dict) -> dict:
    if row["accumulate"] not in TARGETS or (row["accumulate"] == "fp32_blocks" and row["dtype"] == "fp32"):
        return {}  # fp32 operands: fp32_blocks is fp32, and fp32 sums cannot reach fp32's own rounding
    metric, bound = TARGETS[row["accumulate"]]
    return {"target": f"{metric} <= {bound}", "meets_target": row[metric] <= bound}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--comm", choices=("ring", "allgather"), default="ring")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {', '.join((*MODES, FEWEST))}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=RESULTS, help="JSONL file for the results ('' for none)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed to the ranks")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU, the ring simulated (modes default to "
                        f"{','.join(CUDA_MODES)}); cpu: --cp gloo processes")
    p.add_argument("--mask", choices=MASKS, default=None,
                   help="the masked ring, simulated in this process (cpu only; modes default to "
                        f"{','.join(MASK_MODES)})")
    p.add_argument("--window", type=int, default=None, help="--mask window's tokens (default: seq // 8)")
    p.add_argument("--load-balance", choices=("head_tail", "documents"), default="head_tail",
                   help="--mask document's layout: head-tail over the sequence, or each document over all ranks")
    a = p.parse_args(argv)
    if a.device == "cuda" and a.modes == ",".join(MODES):
        a.modes = ",".join(CUDA_MODES)
    if a.mask or a.window is not None:
        check_mask_flags(p, a)
    cfg = dict(seq=a.seq, heads=a.heads, kv_heads=a.kv_heads or a.heads, dim=a.dim, batch=a.batch,
               dtype=a.dtype, causal=a.causal, comm=a.comm, seed=a.seed, modes=a.modes.split(","),
               mask=a.mask, window=a.window, load_balance=a.load_balance)
    masks, mask_detail = mask_args(cfg) if a.mask else ({}, {})
    if a.mask == "document":  # both layouts' work per rank with these documents (gradsched.cp.balance)
        from gradsched.cp.balance import imbalance, pairs_per_rank
        for name, lb in (("head_tail", True), ("documents", "documents")):
            work = pairs_per_rank(masks["position_ids"], a.cp, causal=a.causal, load_balance=lb)
            mask_detail.update({f"pairs_per_rank_{name}": work, f"imbalance_{name}": round(imbalance(work), 3)})
            log(f"documents {mask_detail['doc_lengths']}, layout {name}: visible pairs per rank {work}, "
                f"imbalance {mask_detail[f'imbalance_{name}']} (the busiest rank over the mean)")
        mask_detail["load_balance"] = a.load_balance
    seen = None
    if a.mask:
        vis = visibility(cfg, **masks)
        seen = {"out": vis.any(-1), "dq": vis.any(-1), "dk": vis.any(-2), "dv": vis.any(-2)}

    q, k, v, dout = (x.to(a.device) for x in make_inputs(cfg))
    t0 = time.perf_counter()
    ref = fp64_reference(q, k, v, dout, a.causal, vis if a.mask else None)
    log(f"fp64 reference: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    if a.mask:
        single = single_process(q, k, v, dout, a.causal, vis)
    else:
        single = (single_cuda if a.device == "cuda" else single_process)(q, k, v, dout, a.causal)
    log(f"single device ({a.dtype}): {time.perf_counter() - t0:.1f} s")

    if a.mask:
        simulated = simulated_masked(q, k, v, dout, cfg, a.cp, masks)
        device = "cpu, ring simulated in one process"
    elif a.device == "cuda":
        simulated = simulated_on_cuda(q, k, v, dout, cfg, a.cp)
        device = torch.cuda.get_device_name() + ", ring simulated on one GPU"
    else:
        t0 = time.perf_counter()
        per_rank = run_ranks(_rank, a.cp, cfg, timeout_s=a.timeout, collective_timeout_s=a.timeout)
        log(f"{a.cp} ranks: {time.perf_counter() - t0:.1f} s in all")
        device = "cpu, gloo"

    rows = []
    for mode in cfg["modes"]:
        if a.mask or a.device == "cuda":
            ring, seconds = simulated[mode]
        else:
            ring = [unshard([r[mode][0][i] for r in per_rank], a.cp, dim=2) for i in range(4)]
            seconds = max(r[mode][1] for r in per_rank)
        for name, x, s, r in zip(TENSORS, ring, single, ref):
            stats = masked_metrics(x, s, r, seen[name], DTYPES[a.dtype]) if a.mask else metrics(x, s, r)
            row = {"bench": "cp_numerics", "accumulate": mode, "cp": a.cp, "tensor": name,
                   **stats, "seq": a.seq, "heads": a.heads, "kv_heads": cfg["kv_heads"],
                   "dim": a.dim, "batch": a.batch, "dtype": a.dtype, "causal": a.causal, "mask": a.mask,
                   **mask_detail, "comm": "allgather (torch default)" if mode == "torch_ring" else a.comm,
                   "ring_seconds": round(seconds, 2), "device": device}
            rows.append({**row, **target_check(row)} if a.mask else row)
    for row in rows:
        if row.get("meets_target") is False:
            log(f"target missed: {row['accumulate']} {row['tensor']} {row['target']} "
                f"({row[row['target'].split()[0]]:.3f})")
    emit(rows, a.out, append=a.mask is not None)  # masked rows join the unmasked ones
    return rows


def check_mask_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """What a masked run cannot do, refused before any work."""
    if a.window is not None and (a.mask != "window" or a.window < 1):
        p.error("--window is a positive number of tokens, for --mask window")
    if a.device != "cpu":
        p.error("--mask runs on --device cpu only (the masked ring simulated in one process)")
    if a.mask == "window" and not a.causal:
        p.error("--mask window needs --causal (windows are causal)")
    if a.comm != "ring":
        p.error("--mask runs comm='ring' (allgather takes no masks)")
    if a.seq < 5:
        p.error("--mask needs --seq >= 5")
    if a.load_balance == "documents" and (a.mask != "document" or not a.causal):
        p.error("--load-balance documents is for --mask document --causal (it balances causal work)")
    if a.modes == ",".join(MODES):
        a.modes = ",".join(MASK_MODES)
    bad = set(a.modes.split(",")) - set(MASK_MODES)
    if bad:
        p.error(f"--mask takes modes from {','.join(MASK_MODES)}, not {','.join(sorted(bad))}")


if __name__ == "__main__":
    main()
