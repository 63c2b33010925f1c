"""The attention lowering pass (passes/context_parallel.py) on Dynamo graphs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from gradsched.cp.layout import shard, unshard
from gradsched.launch import run_ranks
from gradsched.cp.ring_attention import RingAttentionError, check_attention_call, ring_attention
from gradsched.passes.context_parallel import ContextParallelReport, RingSpec, lower_attention_to_ring

B, H, KV, L, D = 1, 4, 2, 8, 8  # L: one rank's slice of the sequence


def dynamo_graph(fn, *args) -> fx.GraphModule:
    """The graph a torch.compile backend receives for fn(*args)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def qkv(heads=H, kv_heads=KV, length=L):
    return (torch.randn(B, heads, length, D, requires_grad=True), torch.randn(B, kv_heads, length, D),
            torch.randn(B, kv_heads, length, D))


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def ring_spec(group, cp, **kw):
    return RingSpec(group, cp, attention=ring_attention, check=check_attention_call, **kw)


def lower_with_report(gm, **kw):
    return lower_attention_to_ring(gm, ring_spec("cp", kw.pop("cp", 2), **kw))


def lower(gm, **kw):
    return lower_with_report(gm, **kw)[0]


def two_layers(q, k, v):
    x = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(x, k, v, is_causal=True, enable_gqa=True)


def test_every_sdpa_call_becomes_one_ring_call_on_the_cp_group():
    gm = lower(dynamo_graph(two_layers, *qkv()))
    assert not calls(gm, torch._C._nn.scaled_dot_product_attention)
    rings = calls(gm, ring_attention)
    assert len(rings) == 2
    for node in rings:
        assert node.args[3] == "cp"
        assert node.kwargs["causal"] is True and node.kwargs["load_balance"] is True


def test_ring_nodes_keep_the_replaced_calls_fake_values():
    gm = dynamo_graph(two_layers, *qkv())
    before = [n.meta["example_value"] for n in calls(gm, torch._C._nn.scaled_dot_product_attention)]
    after = [n.meta["example_value"] for n in calls(lower(gm), ring_attention)]
    assert [(v.shape, v.dtype) for v in after] == [(v.shape, v.dtype) for v in before]


def test_report_records_each_lowered_call():
    report = lower_with_report(dynamo_graph(two_layers, *qkv()))[1]
    assert isinstance(report, ContextParallelReport) and report.cp == 2
    assert [(c.causal, c.q_heads, c.kv_heads) for c in report.lowered] == [(True, H, KV)] * 2
    assert all("two_layers" in c.where for c in report.lowered)
    assert report.left_local == []


def test_options_reach_the_ring_call():
    gm = lower(dynamo_graph(two_layers, *qkv()), accumulate="fp32_blocks", comm="allgather",
               load_balance=False)
    kwargs = calls(gm, ring_attention)[0].kwargs
    assert (kwargs["accumulate"], kwargs["comm"], kwargs["load_balance"]) == ("fp32_blocks", "allgather", False)


def test_explicit_scale_is_kept():
    def scaled(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    assert calls(lower(dynamo_graph(scaled, *qkv())), ring_attention)[0].kwargs["scale"] == 0.25


def test_causal_default_decides_calls_that_do_not_say():
    def unstated(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert calls(lower(dynamo_graph(unstated, *qkv())), ring_attention)[0].kwargs["causal"] is False
    gm = lower(dynamo_graph(unstated, *qkv()), causal_default=True)
    assert calls(gm, ring_attention)[0].kwargs["causal"] is True


def test_aten_cpu_flash_call_is_lowered_and_its_lse_kept():
    def aten_flash(q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out * lse.unsqueeze(-1)
    gm = lower(dynamo_graph(aten_flash, *qkv(kv_heads=H)))
    (ring,) = calls(gm, ring_attention)
    assert ring.kwargs["return_lse"] is True
    assert {u.target.__name__ for u in ring.users} == {"getitem"}


def test_aten_sdpa_call_is_lowered():
    def aten_sdpa(q, k, v):
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, None, 0.0, True)
    gm = lower(dynamo_graph(aten_sdpa, *qkv(kv_heads=H)))
    assert len(calls(gm, ring_attention)) == 1


def flex_attention(q, k, v):  # stands for an attention form the pass does not lower
    return q


torch.fx.wrap("flex_attention")


def test_attention_of_other_forms_is_reported_as_left_local():
    gm = fx.symbolic_trace(lambda q, k, v: flex_attention(q, k, v) + 1)
    _, report = lower_with_report(gm)
    assert report.lowered == [] and len(report.left_local) == 1 and "flex_attention" in report.left_local[0]


# ---- refused at compile time ----------------------------------------------------------------

def traced(fn, *shapes):
    """fn traced symbolically, inputs given fake values of `shapes` (no shape checks run)."""
    gm = fx.symbolic_trace(fn)
    for node, shape in zip((n for n in gm.graph.nodes if n.op == "placeholder"), shapes):
        node.meta["val"] = torch.empty(shape, device="meta")
    return gm


def test_attn_mask_tensor_is_refused_naming_the_call():
    def masked(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    gm = dynamo_graph(masked, *qkv(kv_heads=H), torch.ones(L, L, dtype=torch.bool))
    with pytest.raises(RingAttentionError, match=r"scaled_dot_product_attention '\w+' at .*masked.*"
                                                  r"attn_mask tensor.*Use is_causal=True"):
        lower(gm)


def test_dropout_in_training_is_refused():
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0,
                                                  is_causal=True)
    module = Attention()
    with pytest.raises(RingAttentionError, match=r"dropout_p=0.1.*Set the model's attention dropout to 0.0"):
        lower(dynamo_graph(module, *qkv(kv_heads=H)))
    assert len(calls(lower(dynamo_graph(module.eval(), *qkv(kv_heads=H))), ring_attention)) == 1


def test_query_heads_not_a_multiple_of_kv_heads_are_refused():
    gm = traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                (B, 3, L, D), (B, 2, L, D), (B, 2, L, D))
    with pytest.raises(RingAttentionError, match="3 query heads are not a multiple of 2"):
        lower(gm)


def test_a_value_head_size_other_than_the_querys_is_refused_for_the_ring_and_runs_under_a2a():
    # the block kernels take one head size; the all-to-all runs SDPA itself, which takes any
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    shapes = (B, H, L, D), (B, H, L, D), (B, H, L, D // 2)
    with pytest.raises(RingAttentionError, match=rf"sizes {D}, {D} and {D // 2}.*comm='a2a'.*pad the value heads"):
        lower(traced(attend, *shapes))
    assert len(calls(lower(traced(attend, *shapes), comm="a2a"), ring_attention)) == 1


def test_odd_local_sequence_under_the_balanced_causal_layout_is_refused():
    gm = dynamo_graph(two_layers, *qkv(length=7))
    with pytest.raises(RingAttentionError, match=r"sequence length 14 is not divisible by 2\*cp=4"):
        lower(gm)
    plain = lower(dynamo_graph(two_layers, *qkv(length=7)), load_balance=False, comm="allgather")
    assert len(calls(plain, ring_attention)) == 2


def test_a_call_through_gradsched_masks_is_named_by_the_users_line_not_gradscheds():
    from gradsched.masks import attention

    def users_layer(q, k, v):
        return attention(q, k, v, window=4)

    _, report = lower_with_report(dynamo_graph(users_layer, *qkv()))
    assert "users_layer" in report.lowered[0].where and "masks.py" not in report.lowered[0].where


def test_the_plain_layouts_causal_ring_is_lowered_like_any_other_scheme():
    # its ranks do unequal work (the first chunk's rank reads no other rank's K/V); gradsched.cp.keep gives
    # every received buffer a use on every rank, so compiled graphs keep the same collectives everywhere
    for comm in ("ring", "allgather", "a2a"):
        assert len(calls(lower(dynamo_graph(two_layers, *qkv()), load_balance=False, comm=comm), ring_attention)) == 2
    full = lower(dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), *qkv()),
                 load_balance=False)  # not causal: every rank uses every step
    assert len(calls(full, ring_attention)) == 1


def test_causality_computed_at_run_time_is_refused():
    gm = traced(lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                (B, H, L, D), (B, H, L, D), (B, H, L, D), ())
    with pytest.raises(RingAttentionError, match="is_causal is computed at run time"):
        lower(gm)


# ---- lowered model on two ranks --------------------------------------------------------------

class TinyAttention(nn.Module):
    """One GQA causal attention layer, as a model writes it."""

    def __init__(self, dim=16, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * head_dim)
        self.o = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


def _model_and_data(dtype=torch.float32, seq=32):
    torch.manual_seed(0)
    model = TinyAttention().to(dtype)
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(2, seq, 16, generator=g).to(dtype) for _ in range(2))
    return model, x, dy


def _run(model, x, dy):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _lowered_worker(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    model, x, dy = _model_and_data()
    reports = []

    def backend(gm, example_inputs):
        gm, report = lower_attention_to_ring(gm, ring_spec(group, world))
        reports.append(report)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    results = _run(compiled, shard(x, world, rank, dim=1), shard(dy, world, rank, dim=1))
    return results, len(reports[0].lowered)


def test_lowered_model_matches_full_sequence_attention_on_two_ranks():
    world = 2
    per_rank = run_ranks(_lowered_worker, world, timeout_s=240)
    assert [n for _, n in per_rank] == [1, 1]
    model, x, dy = _model_and_data()
    single = _run(model, x, dy)
    model.zero_grad()
    reference = _run(model.double(), x.double(), dy.double())
    ranks = [r for r, _ in per_rank]
    got = [unshard([r[i] for r in ranks], world, dim=1) for i in (0, 1)]  # y, dx: sequence-sharded
    got += [sum(r[i] for r in ranks) for i in range(2, len(single))]     # parameter grads: summed
    for i, (g, s, r) in enumerate(zip(got, single, reference)):
        floor = 2 * world * torch.finfo(torch.float32).eps * r.abs().max().item()
        err, single_err = (g.double() - r).abs().max().item(), (s.double() - r).abs().max().item()
        assert err <= 2 * single_err + floor, f"output {i}: {err:.3g} > 2 x {single_err:.3g} + {floor:.3g}"


def test_auto_is_resolved_per_call_at_compile_time_and_the_report_says_why():
    gm, report = lower_with_report(dynamo_graph(two_layers, *qkv()), comm="auto")  # 4 / 2 heads over cp=2
    assert [n.kwargs["comm"] for n in calls(gm, ring_attention)] == ["a2a", "a2a"]
    assert [(c.comm, c.a2a_degree) for c in report.lowered] == [("a2a", 2)] * 2
    assert "one unchanged kernel call" in report.lowered[0].why


def test_a_window_over_the_whole_sequence_is_no_mask_to_auto():
    from gradsched.masks import attention

    def layers(q, k, v):  # L tokens per rank at cp=2: a window of 2L hides nothing, one of L - 1 does
        return attention(q, k, v, causal=True, window=2 * L) + attention(q, k, v, causal=True, window=L - 1)

    gm, report = lower_with_report(dynamo_graph(layers, *qkv()), comm="auto")
    assert [(c.comm, c.window) for c in report.lowered] == [("a2a", None), ("ring", L - 1)]


def test_hybrid_is_lowered_with_its_degree():
    gm, report = lower_with_report(dynamo_graph(two_layers, *qkv()), cp=4, comm="hybrid")
    assert [(n.kwargs["comm"], n.kwargs["a2a_degree"]) for n in calls(gm, ring_attention)] == [("hybrid", 2)] * 2


def test_the_document_balanced_layout_refuses_attention_that_is_not_told_the_documents():
    # load_balance="documents" reorders the sequence: a call without seq_idx would attend across documents
    with pytest.raises(RingAttentionError, match="not told the documents"):
        lower(dynamo_graph(two_layers, *qkv()), load_balance="documents")


def test_the_document_balanced_layout_lowers_calls_given_seq_idx_and_reports_it():
    from gradsched.masks import attention

    def layer(q, k, v, seq_idx):
        return attention(q, k, v, seq_idx=seq_idx)

    gm, report = lower_with_report(dynamo_graph(layer, *qkv(), torch.zeros(1, L, dtype=torch.long)),
                                   load_balance="documents")
    (node,) = calls(gm, ring_attention)
    assert node.kwargs["load_balance"] is True and "seq_idx" in node.kwargs
    assert report.lowered[0].load_balance == "documents"


# ---- attention inside higher-order ops' bodies --------------------------------------------------

def calls_anywhere(gm, target):
    return [n for sub in gm.modules() if isinstance(sub, fx.GraphModule) for n in calls(sub, target)]


def checkpointed_layers(mode):
    """two_layers with each layer under torch.utils.checkpoint, as a user or HF's
    gradient_checkpointing_enable writes it (Dynamo puts each layer's body in a subgraph)."""
    from tiny_gpt import checkpoint_kwargs

    def layer(x, k, v):
        return F.scaled_dot_product_attention(x, k, v, is_causal=True, enable_gqa=True)

    def fn(q, k, v):
        x = torch.utils.checkpoint.checkpoint(layer, q, k, v, **checkpoint_kwargs(mode))
        return torch.utils.checkpoint.checkpoint(layer, x, k, v, **checkpoint_kwargs(mode))
    return fn


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "selective"])
def test_attention_inside_an_activation_checkpoint_is_lowered_in_its_body(mode):
    gm, report = lower_with_report(dynamo_graph(checkpointed_layers(mode), *qkv()))
    assert len(calls_anywhere(gm, ring_attention)) == 2 and not calls(gm, ring_attention)  # in the bodies
    assert not calls_anywhere(gm, torch._C._nn.scaled_dot_product_attention)
    assert [c.inside for c in report.lowered] == ["activation checkpoint"] * 2 and report.left_local == []
    for sub in gm.modules():  # the ring nodes keep the replaced calls' fake values
        for n in calls(sub, ring_attention):
            assert n.meta["example_value"].shape == (B, H, L, D)


def test_attention_in_a_branch_is_left_local_naming_the_branch_not_lowered():
    def branchy(q, k, v):  # a branch some ranks may not take: a ring there could hang
        return torch.cond(q.sum() > 0, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          lambda q, k, v: q * 2, (q, k, v))
    gm, report = lower_with_report(dynamo_graph(branchy, *qkv(kv_heads=H)))
    assert report.lowered == [] and len(report.left_local) == 1
    assert "inside cond's body" in report.left_local[0] and "test_context_parallel_pass.py" in report.left_local[0]


def test_the_scan_finds_attention_left_in_a_subgraph_at_its_line(monkeypatch):
    # mutation: a lowering that did not walk checkpoint bodies would leave the calls local; the scan the
    # backend runs after lowering still names both, with the user's line
    from gradsched.passes import context_parallel
    from gradsched.passes.context_parallel import attention_left
    assert attention_left(lower(dynamo_graph(checkpointed_layers("non_reentrant"), *qkv()))) == []
    monkeypatch.setattr(context_parallel, "INLINE_BODIES", {})
    gm, report = lower_with_report(dynamo_graph(checkpointed_layers("non_reentrant"), *qkv()))
    assert report.lowered == []
    left = attention_left(gm)
    assert len(left) == 2 and all("scaled_dot_product_attention" in w and "in module '" in w and
                                  "test_context_parallel_pass.py" in w for w in left)


@pytest.fixture
def fake_world_of_two():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _collectives_per_graph(fn, group, *args) -> dict:
    """The number of collectives in the forward and the backward graph AOTAutograd makes of fn, lowered."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from gradsched.passes.graph_utils import is_collective
    counts = {}

    def count(where):
        def compiler(gm, example_inputs):
            counts[where] = sum(1 for n in gm.graph.nodes if is_collective(n))
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, example_inputs):
        lower_attention_to_ring(gm, ring_spec(group, 2))
        return aot_autograd(fw_compiler=count("fw"), bw_compiler=count("bw"), decompositions=select_decomp_table(),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args).sum().backward()
    return counts


def test_a_checkpointed_layers_backward_recomputes_the_ring(fake_world_of_two):
    # the recomputation recomputes the ring (its collectives run again in the backward, the same graph
    # on every rank), instead of saving its output as a plain layer's backward would
    plain = _collectives_per_graph(two_layers, fake_world_of_two, *qkv())
    for mode in ("non_reentrant", "selective"):
        got = _collectives_per_graph(checkpointed_layers(mode), fake_world_of_two, *qkv())
        assert got["fw"] == plain["fw"] > 0 and got["bw"] == plain["bw"] + plain["fw"], (mode, got, plain)
