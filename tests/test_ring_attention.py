"""Ring attention (gradsched.cp.ring_attention) against attention over the whole sequence.

References are independent of the ring: softmax(QK^T)V in float64 over the full
sequence, with autograd for dq/dk/dv. Accuracy bound: the ring's error against that
reference may be at most what the single-device kernel of the same dtype achieves
on the same inputs, with margin for the roundings the ring adds:

    max error  <= 2 x single-device max error + 2 * cp * eps(dtype) * max|reference|
    mean error <= 1.5 x single-device mean error     (fp32 accumulation)

The ring rounds each of its cp block results once more than one kernel over the whole
sequence does (the block output, or the partial sum), and merging adds one more
rounding per step: at most two roundings per step at the largest magnitude, hence the
floor. Such an extra rounding is independent of the kernel's own error and of the same
size, which makes the typical error about sqrt(2) = 1.41 times the kernel's: hence 1.5
for the mean.

Multi-rank runs are grouped: one spawn per world size runs every case, the tests
then check one behaviour each on its results.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gradsched.cp.layout import gather_sequence, shard, unshard
from gradsched.launch import run_ranks
from gradsched.cp.ring_attention import RingAttentionError, ring_attention
from gradsched.cp.ring_simulation import simulate_ring

B, HQ, S, D = 1, 4, 32, 16


# ---- references ---------------------------------------------------------------------------

def fp64_attention(q, k, v, causal, grad_out):
    """(out, dq, dk, dv) of plain softmax attention in float64 over the whole sequence."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    out = scores.softmax(-1) @ ve
    out.backward(grad_out.double())
    return out.detach(), q.grad, k.grad, v.grad


def single_device(q, k, v, causal, grad_out):
    """(out, dq, dk, dv) of the CPU flash kernel over the whole sequence, in the input dtype."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), 0.0, causal)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def inputs(dtype, kv_heads, seed, seq=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, seq, D, generator=g).to(dtype) for h in (HQ, kv_heads, kv_heads, HQ)]


def errors(x, ref):
    """Max and mean |x - ref|; both inf if either holds a NaN or an inf."""
    x, ref = x.double(), ref.double()
    if not (torch.isfinite(x).all() and torch.isfinite(ref).all()):
        return math.inf, math.inf
    e = (x - ref).abs()
    return e.max().item(), e.mean().item()


def check_accuracy(got, single, ref, dtype, cp, mean_factor=1.5):
    """Failures of the bound in the module docstring, one line per tensor."""
    failures = []
    for name, g, s, r in zip(("out", "dq", "dk", "dv"), got, single, ref):
        (gmax, gmean), (smax, smean) = errors(g, r), errors(s, r)
        if math.inf in (gmax, smax):  # a NaN or an inf in the ring's, the single device's or the reference
            failures.append(f"{name}: not finite (max error {gmax:.3g}, single device's {smax:.3g})")
            continue
        floor = 2 * cp * torch.finfo(dtype).eps * r.abs().max().item()
        if gmax > 2 * smax + floor:
            failures.append(f"{name}: max error {gmax:.3g} > 2 x {smax:.3g} + {floor:.3g}")
        if mean_factor is not None and gmean > mean_factor * smean:
            failures.append(f"{name}: mean error {gmean:.3g} > {mean_factor} x {smean:.3g}")
    return failures


# ---- the multi-rank runs --------------------------------------------------------------------

def _case(dtype=torch.float32, causal=True, kv_heads=2, load_balance=True, accumulate="fp32",
          comm="ring", seed=0):
    return dict(dtype=dtype, causal=causal, kv_heads=kv_heads, load_balance=load_balance,
                accumulate=accumulate, comm=comm, seed=seed)


def _name(c):
    heads = {HQ: "mha", 1: "mqa"}.get(c["kv_heads"], "gqa")
    return "-".join([str(c["dtype"]).removeprefix("torch."), "causal" if c["causal"] else "full",
                     heads, "balanced" if c["load_balance"] else "plain", c["accumulate"], c["comm"]])


MAIN = [_case(dtype, causal, kv, seed=i) for i, (dtype, causal, kv) in enumerate(
    (d, c, kv) for d in (torch.float32, torch.bfloat16) for c in (True, False) for kv in (HQ, 2))]
EXTRA = [
    _case(torch.bfloat16, True, 2, load_balance=False, seed=20),
    _case(torch.float32, True, HQ, load_balance=False, seed=21),
    _case(torch.bfloat16, True, 1, seed=22),
    _case(torch.bfloat16, True, 2, accumulate="input", seed=23),
    _case(torch.bfloat16, True, 2, accumulate="fp32_blocks", seed=24),
    _case(torch.bfloat16, True, 2, comm="allgather", seed=25),
    _case(torch.float32, False, 2, comm="allgather", seed=26),
]
CASES = {_name(c): c for c in MAIN + EXTRA}


def _ring_worker(rank, world, cases):
    """Every case on this rank: local results, gathered results, and saved-tensor sizes."""
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    results = {}
    for name, c in cases.items():
        q, k, v, dout = inputs(c["dtype"], c["kv_heads"], c["seed"])
        lb = c["load_balance"]
        ql, kl, vl = (shard(x, world, rank, dim=2, load_balance=lb).requires_grad_() for x in (q, k, v))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = ring_attention(ql, kl, vl, group, causal=c["causal"], accumulate=c["accumulate"],
                                 comm=c["comm"], load_balance=lb)
        out.backward(shard(dout, world, rank, dim=2, load_balance=lb))
        local = (out.detach(), ql.grad, kl.grad, vl.grad)
        results[name] = dict(local=local, saved=sum(saved),
                             gathered=[gather_sequence(t, group, dim=2, load_balance=lb) for t in local])
    try:  # an odd local sequence under the load-balanced causal layout
        x = torch.randn(B, HQ, 3, D)
        ring_attention(x, x, x, group, causal=True)
        results["odd_error"] = None
    except RingAttentionError as e:
        results["odd_error"] = str(e)
    return results


_RUNS: dict = {}


def ring_run(world):
    """Results of the world-size run (spawned once per test session)."""
    if world not in _RUNS:
        _RUNS[world] = run_ranks(_ring_worker, world, CASES, timeout_s=240)
    return _RUNS[world]


def ring_result(world, name):
    """(out, dq, dk, dv) over the whole sequence, in natural order, from the local shards."""
    c = CASES[name]
    per_rank = [r[name]["local"] for r in ring_run(world)]
    return [unshard([p[i] for p in per_rank], world, dim=2, load_balance=c["load_balance"])
            for i in range(4)]


def _given(name):
    c = CASES[name]
    q, k, v, dout = inputs(c["dtype"], c["kv_heads"], c["seed"])
    return c, (q, k, v, dout)


WORLDS = (2, 4, 8)  # 8: the numerics benchmark's cp, 2 tokens per chunk


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [_name(c) for c in MAIN + EXTRA[:3]])
def test_ring_matches_fp64_within_single_device_bound(world, name):
    c, (q, k, v, dout) = _given(name)
    got = ring_result(world, name)
    failures = check_accuracy(got, single_device(q, k, v, c["causal"], dout),
                              fp64_attention(q, k, v, c["causal"], dout), c["dtype"], world)
    assert not failures, f"cp={world} {name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_allgather_comm_matches_fp64_within_single_device_bound(world):
    for name in (n for n, c in CASES.items() if c["comm"] == "allgather"):
        c, (q, k, v, dout) = _given(name)
        failures = check_accuracy(ring_result(world, name), single_device(q, k, v, c["causal"], dout),
                                  fp64_attention(q, k, v, c["causal"], dout), c["dtype"], world)
        assert not failures, f"cp={world} {name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_fp32_blocks_accumulation_is_no_less_accurate_than_the_single_kernel(world):
    # Nothing is rounded before the final cast, so the mean error is at most the
    # single bf16 kernel's (which rounds probabilities to bf16 inside).
    name = _name(_case(torch.bfloat16, True, 2, accumulate="fp32_blocks", seed=24))
    c, (q, k, v, dout) = _given(name)
    failures = check_accuracy(ring_result(world, name), single_device(q, k, v, True, dout),
                              fp64_attention(q, k, v, True, dout), c["dtype"], world, mean_factor=1.0)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_input_dtype_accumulation_stays_within_the_max_error_bound(world):
    # Accumulating in bf16 rounds at every step: only the max bound is promised.
    name = _name(_case(torch.bfloat16, True, 2, accumulate="input", seed=23))
    c, (q, k, v, dout) = _given(name)
    failures = check_accuracy(ring_result(world, name), single_device(q, k, v, True, dout),
                              fp64_attention(q, k, v, True, dout), c["dtype"], world, mean_factor=None)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_simulation_equals_the_ring_bitwise(world):
    # Same blocks, merges and sums in the same order: the same bits. With allgather,
    # the reduce-scatter sums dK/dV in its own order, so only out and dq are bitwise.
    for name, c in CASES.items():
        q, k, v, dout = inputs(c["dtype"], c["kv_heads"], c["seed"])
        sim = simulate_ring(q, k, v, world, c["causal"], c["accumulate"],
                            load_balance=c["load_balance"], grad_out=dout)
        got = ring_result(world, name)
        exact = 4 if c["comm"] == "ring" else 2
        for label, a, b in list(zip(("out", "dq", "dk", "dv"), got, (sim.out, sim.dq, sim.dk, sim.dv)))[:exact]:
            assert torch.equal(a, b), f"cp={world} {name}: {label} differs from the simulation"


@pytest.mark.parametrize("world", WORLDS)
def test_gathered_outputs_equal_the_unsharded_local_outputs(world):
    for name in CASES:
        gathered = ring_run(world)[0][name]["gathered"]
        for a, b in zip(gathered, ring_result(world, name)):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("world", WORLDS)
def test_saved_tensors_are_only_the_local_q_k_v_out_and_lse(world):
    # Memory saved for backward does not grow with cp: no visiting K/V is kept.
    for name, c in CASES.items():
        local = S // world
        kv = B * c["kv_heads"] * local * D
        out_elems = B * HQ * local * D
        expected = 2 * out_elems + 2 * kv + B * HQ * local  # q, out, k, v, lse
        for r, res in enumerate(ring_run(world)):
            assert res[name]["saved"] == expected, f"cp={world} rank {r} {name}"


def test_odd_local_sequence_under_the_balanced_causal_layout_is_refused():
    message = ring_run(2)[0]["odd_error"]
    assert message is not None and "not divisible by 2*cp=4" in message and "Pad" in message


# ---- compiled -------------------------------------------------------------------------------

def _compiled_worker(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    q, k, v, dout = inputs(torch.bfloat16, 2, seed=7)

    def attend(ql, kl, vl):
        return ring_attention(ql, kl, vl, group, causal=True)

    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True, backend="inductor")):
        ql, kl, vl = (shard(x, world, rank, dim=2).requires_grad_() for x in (q, k, v))
        out = fn(ql, kl, vl)
        out.backward(shard(dout, world, rank, dim=2))
        results.append([out.detach(), ql.grad, kl.grad, vl.grad])
    return results


def test_ring_compiles_fullgraph_with_inductor_and_matches_eager():
    world = 2
    per_rank = run_ranks(_compiled_worker, world, timeout_s=300)
    q, k, v, dout = inputs(torch.bfloat16, 2, seed=7)
    ref = fp64_attention(q, k, v, True, dout)
    eager, compiled = ([unshard([r[which][i] for r in per_rank], world, dim=2) for i in range(4)]
                       for which in (0, 1))
    for name, e, c, r in zip(("out", "dq", "dk", "dv"), eager, compiled, ref):
        ulp = torch.finfo(torch.bfloat16).eps * r.abs().max().item()
        assert (e.double() - c.double()).abs().max().item() <= ulp, f"{name}: compiled != eager"
    assert not check_accuracy(compiled, single_device(q, k, v, True, dout), ref, torch.bfloat16, world)


# ---- refused calls (one process) --------------------------------------------------------------

def test_query_heads_not_a_multiple_of_kv_heads_are_refused():
    q, k, v = torch.randn(B, 3, S, D), torch.randn(B, 2, S, D), torch.randn(B, 2, S, D)
    with pytest.raises(RingAttentionError, match=r"3 query heads are not a multiple of 2 key/value heads"):
        simulate_ring(q, k, v, 2, causal=True)


def test_sequence_not_divisible_by_twice_cp_is_refused():
    q = torch.randn(B, HQ, 12, D)
    with pytest.raises(RingAttentionError, match=r"sequence length 12 is not divisible by 2\*cp=8.*Pad"):
        simulate_ring(q, q, q, 4, causal=True)


def test_unknown_accumulate_mode_is_refused():
    q = torch.randn(B, HQ, S, D)
    with pytest.raises(RingAttentionError, match=r"accumulate='bf16' is unknown"):
        simulate_ring(q, q, q, 2, causal=True, accumulate="bf16")
