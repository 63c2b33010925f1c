"""Ulysses attention (comm="a2a"): context parallelism by heads, against attention over the whole sequence.

It runs the single-device kernel on whole sequences of a subset of the heads, so its
error against fp64 is the single device's own: the mean bound is 1.0x the single-device
kernel's mean error (the ring's is 1.5x), with the max bound of tests/test_ring_attention.py.
"""
import pytest
import torch
import torch.distributed as dist

from gradsched.cp.layout import shard, unshard
from gradsched.launch import run_ranks
from gradsched.cp.ring_attention import RingAttentionError, ring_attention
from gradsched.cp.comm import check_attention_call
from test_ring_attention import HQ, S, check_accuracy, fp64_attention, inputs, single_device

CASES = {  # name -> (dtype, causal, kv heads, load_balance)
    "bf16-causal-gqa": (torch.bfloat16, True, 2, True),
    "bf16-causal-mqa-plain": (torch.bfloat16, True, 1, False),
    "fp32-full-mha": (torch.float32, False, HQ, True),
    "fp32-causal-gqa": (torch.float32, True, 2, True),
}


HYBRID = {  # comm="hybrid" at cp=4, a2a_degree 2 (all-to-all over ranks {0,1}, {2,3}; ring over {0,2}, {1,3})
    "hybrid-bf16-causal-gqa": (torch.bfloat16, True, 2, True),  # 2 key/value heads split over 2 ranks
    "hybrid-fp32-causal-mqa": (torch.float32, True, 1, True),  # the one key/value head repeated to both
    "hybrid-fp32-full-mha-plain": (torch.float32, False, HQ, False),
}
# compiled by Inductor as well, at cp 2 (each compiled case costs the suite a cold compile per rank); the hybrid
# under Inductor: tests/test_masked_attention.py compiles a masked one at cp 4, against fp64
COMPILED = {2: ("bf16-causal-gqa",), 4: ()}


def _worker(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    out = {}
    cases = dict(CASES, **(HYBRID if world == 4 else {}))
    for i, (name, (dtype, causal, kv, lb)) in enumerate(cases.items()):
        q, k, v, dout = inputs(dtype, kv, seed=40 + i)
        comm = dict(comm="hybrid", a2a_degree=2) if name in HYBRID else dict(comm="a2a")

        def attend(ql, kl, vl):
            return ring_attention(ql, kl, vl, group, causal=causal, load_balance=lb, return_lse=name in HYBRID,
                                  **comm)
        fns = {"eager": attend}
        if name in COMPILED[world]:
            fns["inductor"] = torch.compile(attend, fullgraph=True, backend="inductor")
        for how, fn in fns.items():
            ql, kl, vl = (shard(x, world, rank, dim=2, load_balance=lb).requires_grad_() for x in (q, k, v))
            o = fn(ql, kl, vl)
            o, lse = o if name in HYBRID else (o, None)
            o.backward(shard(dout, world, rank, dim=2, load_balance=lb))
            out[(name, how)] = [o.detach(), ql.grad, kl.grad, vl.grad, lse]
    return out


_RUNS = {}


def result(world, name, how="eager"):
    if world not in _RUNS:
        _RUNS[world] = run_ranks(_worker, world, timeout_s=300)
    lb = {**CASES, **HYBRID}[name][3]
    n = 5 if name in HYBRID else 4
    return [unshard([r[(name, how)][i] for r in _RUNS[world]], world, dim=2, load_balance=lb) for i in range(n)]


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", list(CASES))
def test_a2a_matches_fp64_as_well_as_the_single_device_kernel(world, name):
    dtype, causal, kv, _ = CASES[name]
    q, k, v, dout = inputs(dtype, kv, seed=40 + list(CASES).index(name))
    failures = check_accuracy(result(world, name), single_device(q, k, v, causal, dout),
                              fp64_attention(q, k, v, causal, dout), dtype, world, mean_factor=1.0)
    assert not failures, f"cp={world} {name}:\n" + "\n".join(failures)


def test_a2a_compiles_fullgraph_with_inductor_and_matches_eager():
    for a, b in zip(result(2, "bf16-causal-gqa", "inductor"), result(2, "bf16-causal-gqa")):
        assert (a.double() - b.double()).abs().max().item() <= torch.finfo(torch.bfloat16).eps * b.abs().max().item()


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_matches_fp64_as_well_as_the_ring(name):
    dtype, causal, kv, _ = HYBRID[name]
    q, k, v, dout = inputs(dtype, kv, seed=40 + len(CASES) + list(HYBRID).index(name))
    failures = check_accuracy(result(4, name)[:4], single_device(q, k, v, causal, dout),
                              fp64_attention(q, k, v, causal, dout), dtype, 4)
    assert not failures, f"cp=4 {name}:\n" + "\n".join(failures)


def test_hybrid_returns_the_whole_sequence_log_sum_exp():
    name = "hybrid-fp32-causal-mqa"
    q, k, _, _ = inputs(torch.float32, 1, seed=40 + len(CASES) + list(HYBRID).index(name))
    scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(result(4, name)[4].double(), scores.logsumexp(-1), rtol=0, atol=1e-5)


def test_query_heads_that_do_not_divide_over_cp_are_refused_naming_the_ring():
    with pytest.raises(RingAttentionError, match=r"6 query heads over cp=4.*comm='ring'"):
        check_attention_call("sdpa", q_heads=6, kv_heads=2, local_len=8, cp=4, causal=True, comm="a2a")


def test_kv_heads_that_neither_divide_nor_are_divided_by_cp_are_refused():
    with pytest.raises(RingAttentionError, match=r"3 key/value heads divisible by cp=2, or dividing it"):
        check_attention_call("sdpa", q_heads=6, kv_heads=3, local_len=8, cp=2, causal=True, comm="a2a")
