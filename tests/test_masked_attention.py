"""Context-parallel attention with masks (sliding window, packed documents, padding) against the
whole sequence in one process.

The reference is independent of gradsched.masks: the mask is written out here pair by pair from
the HF conventions (window: i - j < W; a new document wherever position ids do not step by 1;
padding hides keys), the attention computed in float64 with autograd. Accuracy bound: as in
tests/test_ring_attention.py, within what the single-device kernel (the CPU flash kernel with the
same mask over the whole sequence) achieves on the same inputs.

"balanced" masks run the document-balanced layout (load_balance="documents"): the sequence is first
reordered by gradsched.cp.layout.document_order and the documents handed over as seq_idx; the results
are put back in natural order before the comparison, so the reference never sees the reordering.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gradsched.cp.layout import document_order, shard, unshard
from gradsched.masks import attention, document_ids, positions_from_cu_seqlens
from gradsched.launch import run_ranks
from gradsched.cp.ring_attention import RingAttentionError, ring_attention
from gradsched.cp.comm import check_masked_call
from gradsched.cp.ring_simulation import simulate_ring
from tests.test_ring_attention import check_accuracy

B, HQ, KV, S, D = 2, 4, 2, 64, 16
WINDOW = 6  # shorter than a chunk at cp=4 (8 tokens): steps 0, 1 and cp-1 only


def documents():
    """Packed documents of 5, 18, 1, 26 and 14 tokens: position ids restarting at 0."""
    return torch.cat([torch.arange(n) for n in (5, 18, 1, 26, 14)])[None]


def padding():
    """Row 0 left-padded by 9 (its first queries see nothing at all), row 1 right-padded by 13."""
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, :9] = False
    keep[1, -13:] = False
    return keep


def reference_mask(causal, window, position_ids, key_padding):
    """bool [B, S, S], written out pair by pair."""
    doc = None
    if position_ids is not None:
        doc, d = [], 0
        for i, p in enumerate(position_ids[0].tolist()):
            d += i > 0 and p != position_ids[0, i - 1].item() + 1
            doc.append(d)
    m = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for i in range(S):
            for j in range(S):
                m[b, i, j] = ((not causal or j <= i) and (window is None or i - j < window)
                              and (doc is None or doc[i] == doc[j])
                              and (key_padding is None or bool(key_padding[b, j])))
    return m


def fp64_reference(q, k, v, dout, mask):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)  # no key: zeros
    out = p @ v.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def single_device(q, k, v, dout, mask):
    """The CPU flash kernel over the whole sequence with the same mask, in the input dtype."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    add = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))[:, None]
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), 0.0, False, attn_mask=add)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


MASKS = {
    "window": dict(causal=True, window=WINDOW),
    "documents": dict(causal=True, docs=True),
    "padding": dict(causal=True, pad=True),
    "documents+window": dict(causal=True, window=WINDOW, docs=True),
    "documents+padding, not causal": dict(causal=False, docs=True, pad=True),
    "balanced documents": dict(causal=True, docs=True, balanced=True),
    "balanced documents+window": dict(causal=True, window=WINDOW, docs=True, balanced=True),
    "balanced documents+padding": dict(causal=True, docs=True, pad=True, balanced=True),
}


def _case(mask, dtype, comm="ring", seed=0):
    return dict(mask=mask, dtype=dtype, comm=comm, seed=seed)


CASES = {f"{m}-{str(d).removeprefix('torch.')}-{comm}": _case(m, d, comm, i)
         for i, (m, d, comm) in enumerate([(m, d, "ring") for m in MASKS for d in (torch.float32, torch.bfloat16)]
                                          + [(m, torch.float32, "a2a") for m in MASKS]
                                          + [("documents+window", torch.bfloat16, "a2a")]
                                          + [("documents+window", torch.float32, "hybrid"),
                                             ("padding", torch.bfloat16, "hybrid"),
                                             ("balanced documents+window", torch.float32, "hybrid"),
                                             ("balanced documents+padding", torch.bfloat16, "hybrid")])
         if not (m.startswith("balanced") and comm == "a2a" and m != "balanced documents+window")}
# comm="hybrid" needs cp = a2a degree x ring degree with both > 1: cp=4 only (2 x 2)
AT = {2: [n for n in CASES if not n.endswith("hybrid")], 4: list(CASES)}


def given(name):
    c = CASES[name]
    m = MASKS[c["mask"]]
    gen = torch.Generator().manual_seed(c["seed"])
    q, k, v, dout = (torch.randn(B, h, S, D, generator=gen).to(c["dtype"]) for h in (HQ, KV, KV, HQ))
    args = dict(causal=m["causal"], window=m.get("window"), position_ids=documents() if m.get("docs") else None,
                key_padding=padding() if m.get("pad") else None)
    return c, (q, k, v, dout), args


def reordered(name, world, tensors, args):
    """The tensors ([B, H, S, D]) and mask arguments in the document-balanced order at cp=world, with
    seq_idx, for a balanced mask; as given otherwise. Returns (tensors, args, order or None)."""
    if not MASKS[CASES[name]["mask"]].get("balanced"):
        return tensors, args, None
    order = document_order(documents(), world)[0]
    args = dict(args, seq_idx=document_ids(documents()).index_select(1, order),
                position_ids=documents().index_select(1, order) if args["window"] is not None else None,
                key_padding=args["key_padding"].index_select(1, order) if args["key_padding"] is not None else None)
    return tuple(t.index_select(2, order) for t in tensors), args, order


# compiled by Inductor (fullgraph) as well: a hybrid, whose masked all-to-all and masked ring both run compiled
# (one compiled case: each costs the suite about 20 s per rank pair)
COMPILED = {2: [], 4: ["balanced documents+padding-bfloat16-hybrid"]}


def _worker(rank, world, names):
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    results = {}
    for name in names + [f"{n} inductor" for n in COMPILED[world]]:
        base, compiled = name.removesuffix(" inductor"), name.endswith(" inductor")
        c, (q, k, v, dout), args = given(base)
        (q, k, v, dout), args, _ = reordered(base, world, (q, k, v, dout), args)
        ql, kl, vl = (shard(x, world, rank, dim=2).requires_grad_() for x in (q, k, v))
        local = {key: (shard(t, world, rank, dim=1) if isinstance(t, torch.Tensor) else t)
                 for key, t in args.items()}

        def attend(ql, kl, vl, local):
            return ring_attention(ql, kl, vl, group, comm=c["comm"], return_lse=c["comm"] == "ring", **local)
        if compiled:
            attend = torch.compile(attend, fullgraph=True, backend="inductor")
        with torch.profiler.profile(record_shapes=True) as prof:
            got = attend(ql, kl, vl, local)
            out, lse = got if c["comm"] == "ring" else (got, None)
            out.backward(shard(dout, world, rank, dim=2))
        sent = [e for e in prof.events() if "all_to_all_single" in e.name and e.input_shapes]
        moved = sum(math.prod(e.input_shapes[0]) for e in sent) / (kl.numel() + vl.numel())
        results[name] = dict(local=(out.detach(), ql.grad, kl.grad, vl.grad), lse=lse, moved=moved,
                             transfers=len(sent))
    return results


_RUNS: dict = {}


def run(world):
    if world not in _RUNS:
        _RUNS[world] = run_ranks(_worker, world, AT[world], timeout_s=300)
    return _RUNS[world]


def gathered(world, name, how=""):
    """out, dq, dk, dv over the whole sequence, in natural order (how=" inductor": compiled)."""
    per_rank = [r[name + how]["local"] for r in run(world)]
    got = [unshard([p[i] for p in per_rank], world, dim=2) for i in range(4)]
    _, _, order = reordered(name, world, (), given(name)[2])
    return got if order is None else [t.index_select(2, torch.argsort(order)) for t in got]


@pytest.mark.parametrize("world, name", [(w, n) for w in AT for n in AT[w]])
def test_masked_attention_matches_fp64_within_the_single_device_bound(world, name):
    c, (q, k, v, dout), args = given(name)
    mask = reference_mask(args["causal"], args["window"], args["position_ids"], args["key_padding"])
    ref = fp64_reference(q, k, v, dout, mask)
    got = gathered(world, name)
    assert not any(torch.isnan(t).any() for t in got), "NaN in out or gradients"
    failures = check_accuracy(got, single_device(q, k, v, dout, mask), ref, c["dtype"], world)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("-ring") and not n.startswith("balanced")])
def test_one_process_masked_attention_matches_fp64_as_the_single_device_kernel(name):
    # gradsched.masks.attention where nothing lowers it (cp=1, the model in one process): its backward runs the
    # kernel's own backward on the [B, 1, S, S] mask, never [B, H, S, S] fp32 scores
    c, (q, k, v, dout), args = given(name)
    mask = reference_mask(args["causal"], args["window"], args["position_ids"], args["key_padding"])
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, **args)
    out.backward(dout)
    got = (out.detach(), q.grad, k.grad, v.grad)
    assert not any(torch.isnan(t).any() for t in got), "NaN in out or gradients"
    failures = check_accuracy(got, single_device(q, k, v, dout, mask), fp64_reference(q, k, v, dout, mask),
                              c["dtype"], 1, mean_factor=1.0)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world, name", [(w, n) for w in COMPILED for n in COMPILED[w]])
def test_masked_attention_compiled_by_inductor_matches_fp64_within_the_single_device_bound(world, name):
    c, (q, k, v, dout), args = given(name)
    mask = reference_mask(args["causal"], args["window"], args["position_ids"], args["key_padding"])
    got = gathered(world, name, " inductor")
    assert not any(torch.isnan(t).any() for t in got), "NaN in out or gradients"
    failures = check_accuracy(got, single_device(q, k, v, dout, mask), fp64_reference(q, k, v, dout, mask),
                              c["dtype"], world)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", (2, 4))
def test_queries_that_see_nothing_get_zeros_a_finite_lse_and_zero_gradients(world):
    name = "padding-float32-ring"
    _, (q, k, v, dout), args = given(name)
    out, dq, _, _ = gathered(world, name)
    lse = unshard([r[name]["lse"] for r in run(world)], world, dim=2)
    blind = ~reference_mask(True, None, None, args["key_padding"]).any(-1)  # [B, S]: row 0's first 9
    assert blind.sum() == 9
    assert torch.isfinite(lse).all()
    assert out.permute(0, 2, 1, 3)[blind].abs().max() == 0
    assert dq.permute(0, 2, 1, 3)[blind].abs().max() == 0


@pytest.mark.parametrize("world", (2, 4))
def test_a_window_shorter_than_a_chunk_skips_the_ring_steps_nobody_needs(world):
    # cp=4, S=64: chunks of 8 > WINDOW; a rank needs the K/V of steps 1 and cp-1 only (step 0 is local):
    # each K/V sent twice in forward and backward, and twice its dK/dV back; documents need every step.
    # (cp=2: step 1 only.) Measured in K/V sizes from the profiler's recorded input shapes.
    for r in run(world):
        assert r["window-float32-ring"]["moved"] == {2: 3, 4: 6}[world]
        assert r["documents-float32-ring"]["moved"] == 3 * (world - 1)
        assert r["window-float32-ring"]["transfers"] == 3  # K/V, K/V again, dK/dV: ordered by data


@pytest.mark.parametrize("world", (2, 4))
def test_simulation_equals_the_ring_bitwise(world):
    for name in ("documents+window-bfloat16-ring", "padding-float32-ring", "balanced documents+window-bfloat16-ring"):
        c, (q, k, v, dout), args = given(name)
        (q, k, v, dout), args, order = reordered(name, world, (q, k, v, dout), args)
        sim = simulate_ring(q, k, v, world, args["causal"], grad_out=dout, window=args["window"],
                            position_ids=args["position_ids"], key_padding=args["key_padding"],
                            seq_idx=args.get("seq_idx"))
        back = torch.argsort(order) if order is not None else None
        for a, b in zip((sim.out, sim.dq, sim.dk, sim.dv), gathered(world, name)):
            assert torch.equal(a if back is None else a.index_select(2, back), b), name


def test_a_window_over_explicit_documents_without_positions_is_refused():
    # seq_idx: documents need not be contiguous, so only positions can measure the window
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(RingAttentionError, match="pass position_ids as well"):
        simulate_ring(x, x, x, 2, causal=True, window=4, seq_idx=torch.zeros(1, 8, dtype=torch.long))


def test_a_window_without_causal_attention_is_refused():
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(RingAttentionError, match="window without causal"):
        simulate_ring(x, x, x, 2, causal=False, window=4)


def test_a_window_that_is_not_a_positive_int_is_refused():
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(RingAttentionError, match="positive number of tokens"):
        simulate_ring(x, x, x, 2, causal=True, window=0)


def test_position_ids_for_other_tokens_than_the_queries_are_refused():
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(RingAttentionError, match="position_ids covers 7 tokens"):
        simulate_ring(x, x, x, 2, causal=True, position_ids=torch.arange(7)[None])


def test_allgather_with_a_mask_is_refused_naming_the_alternatives():
    with pytest.raises(RingAttentionError, match="comm='ring'"):
        check_masked_call("ring_attention", comm="allgather", cp=2, local_len=8, load_balance=True)


@pytest.mark.parametrize("name", ["window-bfloat16-ring", "balanced documents-bfloat16-ring",
                                  "padding-bfloat16-ring"])
@pytest.mark.parametrize("world", (2, 4))
def test_bf16_results_are_no_less_accurate_than_the_single_device(world, name):
    # a key chunk's dK/dV (window) or a row's dq (documents in pieces) sums kernel calls: in fp32 mode they
    # must not be rounded to bf16 before that sum (they were: 1.2x and 1.05x the single device's mean error
    # at cp_numerics' size); the forward's calls split keys otherwise than the single device's (out was 1.002x)
    c, (q, k, v, dout), args = given(name)
    mask = reference_mask(args["causal"], args["window"], args["position_ids"], args["key_padding"])
    ref, single = fp64_reference(q, k, v, dout, mask), single_device(q, k, v, dout, mask)
    for label, got, s, r in zip(("out", "dq", "dk", "dv"), gathered(world, name), single, ref):
        ring_err, single_err = ((t.double() - r).abs().mean().item() for t in (got, s))
        assert ring_err <= single_err, f"{label}: mean error {ring_err:.3g} > the single device's {single_err:.3g}"


def test_document_boundaries_become_positions_that_restart_in_every_document():
    # flash-attn's cu_seqlens [0, 3, 7, 10], an empty document at 7, and a tail past the last boundary
    cu = torch.tensor([0, 3, 7, 7, 10])
    assert positions_from_cu_seqlens(cu).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]]
    assert positions_from_cu_seqlens(cu, total=12).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert document_ids(positions_from_cu_seqlens(cu)).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]

