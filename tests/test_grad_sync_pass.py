"""The grad-sync pass and the verifier on graphs built in one process (no collectives run)."""
import json

import networkx as nx
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from gradsched.passes import SyncSpec, TieCheck, TieLayout, insert_grad_sync, plan_buckets, sink_waits, verify_graph
from gradsched.passes.grad_ready_order import grad_ready_order
from gradsched.passes.graph_utils import META_KEY, is_collective
from gradsched.passes.verify import graph_to_json, main as verify_main, to_nx

TIE = "0:emb~1:head"


def grads_graph(shapes: dict[str, tuple]) -> fx.GraphModule:
    """A graph whose outputs are its gradient inputs, in the given (ready) order."""
    g, fake = fx.Graph(), FakeTensorMode()
    phs = []
    for name, shape in shapes.items():
        ph = g.placeholder(name)
        ph.meta["val"] = fake.from_tensor(torch.empty(shape))
        phs.append(ph)
    g.output(tuple(phs))
    return fx.GraphModule(torch.nn.Module(), g)


def synced(mode, shapes, tied="emb", shard_rank=0, shards=2, bucket_mb=1.0, align=False):
    gm = grads_graph(shapes)
    ready = grad_ready_order(gm, dict(enumerate(shapes)))
    layout = plan_buckets(ready, bucket_mb=bucket_mb, shards=shards, ties={tied: TIE}, align_ties=align)
    spec = SyncSpec(layout, {n: i for i, n in enumerate(shapes)}, group="dp", group_size=shards,
                    shard_rank=shard_rank, tie_groups={TIE: "tie"}, mode=mode)
    gm, RECORDS[gm] = insert_grad_sync(gm, spec)
    return gm, layout


RECORDS = {}  # graph -> the pass's SyncRecord (the verifier reads each gradient's source nodes from it)


def tie_check(gm, layout, name, rank, peers=()):
    b, s = layout.locate(name)
    mine = TieLayout(rank, name, b.index, s.offset, s.numel, b.numel, layout.shards)
    return TieCheck(TIE, "tie", RECORDS[gm].sources[name], [mine, *peers])


STAGE0 = {"w1": (8, 4), "w2": (4,), "emb": (16, 4)}  # the embedding's gradient is ready last
STAGE1 = {"head": (16, 4), "w3": (4, 4)}  # the head's gradient is ready first


def test_tied_first_makes_the_tie_all_reduce_an_input_of_the_bucket_reduction():
    gm, _ = synced("tied_first", STAGE0)
    G = to_nx(gm)
    ar = [n for n, d in G.nodes(data=True) if d["group"] == "tie"]
    rs = [n for n, d in G.nodes(data=True) if d["collective"] == "reduce_scatter"]
    assert len(ar) == 1 and len(rs) == 1
    assert nx.has_path(G, ar[0], rs[0])
    cut = G.subgraph(n for n in G if n != ar[0])
    assert not nx.has_path(cut, "emb", rs[0])


def test_collectives_are_issued_in_bucket_order():
    gm, layout = synced("tied_first", {"a": (300,), "b": (300,), "c": (300,)}, tied="c",
                        bucket_mb=400 * 4 / 2**20)
    tags = [n.meta[META_KEY] for n in gm.graph.nodes if is_collective(n)]
    assert [b.index for b in layout.buckets] == [0, 1, 2]  # 300 + 300 > 400: one gradient per bucket
    # the tie all-reduce goes as soon as its gradient is ready (here: an input), ahead of the buckets
    assert [(t["role"], t["bucket"]) for t in tags] == [
        ("tie_all_reduce", 2), ("dp_reduce", 0), ("dp_reduce", 1), ("dp_reduce", 2)]


@pytest.mark.parametrize("shard", [True, False])
def test_sharded_buckets_are_reduced_one_at_a_time_and_all_reduced_ones_all_at_once(shard):
    """Under shard=True bucket k+1's reduce-scatter reads bucket k's reduced shard (through a zero), so
    its wait, and the freeing of bucket k's whole gradients, comes first in any schedule."""
    shapes = {"a": (300,), "b": (300,), "c": (300,)}
    gm = grads_graph(shapes)
    layout = plan_buckets(grad_ready_order(gm, dict(enumerate(shapes))), bucket_mb=400 * 4 / 2**20, shards=2)
    gm, _ = insert_grad_sync(gm, SyncSpec(layout, {n: i for i, n in enumerate(shapes)}, group="dp",
                                          group_size=2, shard_rank=0, shard=shard))
    sink_waits(gm)
    G = to_nx(gm)
    reductions = [n for n in gm.graph.nodes if is_collective(n)]
    waits = [next(iter(c.users)) for c in reductions]
    assert len(reductions) == 3
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for wait, following in zip(waits, reductions[1:]):
        assert nx.has_path(G, wait.name, following.name) == shard
        assert (order[wait] < order[following]) == shard


@pytest.mark.parametrize("mode", ["tied_first", "shard_aligned", "unsafe_rs_first"])
def test_two_ties_are_all_reduced_in_tie_key_order_whatever_their_ready_order(mode):
    """Two stages see two ties ready in opposite orders; both issue them sorted by tie key."""
    orders = []
    for shapes in ({"a": (8,), "b": (8,), "w": (4,)}, {"w": (4,), "b": (8,), "a": (8,)}):
        gm = grads_graph(shapes)
        ready = grad_ready_order(gm, dict(enumerate(shapes)))
        ties = {"a": "0:a~1:a", "b": "0:b~1:b"}
        layout = plan_buckets(ready, bucket_mb=1.0, shards=2, ties=ties, align_ties=mode != "unsafe_rs_first")
        spec = SyncSpec(layout, {n: i for i, n in enumerate(shapes)}, group="dp", group_size=2, shard_rank=0,
                        tie_groups={"0:a~1:a": "tie", "0:b~1:b": "tie"}, mode=mode)
        insert_grad_sync(gm, spec)
        orders.append([n.meta[META_KEY]["tie"] for n in gm.graph.nodes
                       if is_collective(n) and n.meta[META_KEY].get("tie")])
    assert orders[0] == orders[1] == ["0:a~1:a", "0:b~1:b"]


def test_every_node_keeps_a_fake_value_with_the_right_shape():
    gm, layout = synced("shard_aligned", STAGE0, align=True)
    for n in gm.graph.nodes:
        if n.op not in ("output",):
            assert isinstance(n.meta.get("val"), torch.Tensor), n.name
    outs = gm.graph.output_node().args[0]
    shards = [o.meta["val"].shape for o in outs[len(STAGE0):]]
    assert shards == [(b.numel // 2,) for b in layout.buckets]


def test_synced_gradients_leave_the_outputs_and_shards_are_appended():
    gm, layout = synced("tied_first", STAGE0)
    outs = gm.graph.output_node().args[0]
    assert outs[:3] == (None, None, None) and len(outs) == 3 + len(layout.buckets)


def test_verifier_proves_tied_first():
    gm, layout = synced("tied_first", STAGE0)
    v = verify_graph(gm, [tie_check(gm, layout, "emb", 0)])
    assert v.ok and "only through the tie all-reduce" in v.proofs[0]


def test_verifier_rejects_reduce_scatter_first_with_misaligned_copies():
    gm0, l0 = synced("unsafe_rs_first", STAGE0)
    gm1, l1 = synced("unsafe_rs_first", STAGE1, tied="head")
    peer = tie_check(gm1, l1, "head", 2).layouts[0]
    v = verify_graph(gm0, [tie_check(gm0, l0, "emb", 0, [peer])], rank=0)
    assert not v.ok
    msg = v.hazards[0]
    for needle in ("'emb'", "'head'", "rank 0", "rank 2", "offset 36", "offset 0", "#844"):
        assert needle in msg, needle


def test_verifier_accepts_reduce_scatter_first_when_every_member_shards_alike():
    gm0, l0 = synced("shard_aligned", STAGE0, align=True)
    gm1, l1 = synced("shard_aligned", STAGE1, tied="head", align=True)
    peer = tie_check(gm1, l1, "head", 2).layouts[0]
    v = verify_graph(gm0, [tie_check(gm0, l0, "emb", 0, [peer])])
    assert v.ok and "shards it identically" in v.proofs[0]


def test_verifier_cannot_prove_alignment_without_the_other_members():
    gm, layout = synced("shard_aligned", STAGE0, align=True)
    v = verify_graph(gm, [tie_check(gm, layout, "emb", 0)])
    assert not v.ok and "unproven" in v.hazards[0]


def test_verifier_reports_a_tied_gradient_that_is_never_summed():
    gm, layout = synced("tied_first", STAGE0)
    check = tie_check(gm, layout, "emb", 0)
    check.group = "some_other_group"
    v = verify_graph(gm, [check])
    assert not v.ok and "never all-reduced" in v.hazards[0]


@pytest.mark.parametrize("mode,expect", [("unsafe_rs_first", 1), ("tied_first", 0)])
def test_command_line_verifies_dumps_of_every_rank(tmp_path, capsys, mode, expect):
    gm0, l0 = synced(mode, STAGE0)
    gm1, l1 = synced(mode, STAGE1, tied="head")
    for rank, (gm, lay, name) in {0: (gm0, l0, "emb"), 2: (gm1, l1, "head")}.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(graph_to_json(gm, [tie_check(gm, lay, name, rank)], rank)))
    assert verify_main([str(tmp_path)]) == expect
    out = capsys.readouterr().out
    assert ("HAZARD" in out) == bool(expect)


def test_ready_order_follows_the_nodes_that_produce_each_gradient():
    g, fake = fx.Graph(), FakeTensorMode()
    x = g.placeholder("x")
    x.meta["val"] = fake.from_tensor(torch.empty(3))
    computed_first = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    computed_second = g.call_function(torch.ops.aten.neg.default, (x,))
    for n in (computed_first, computed_second):
        n.meta["val"] = fake.from_tensor(torch.empty(3))
    g.output((computed_second, computed_first))  # output order is not ready order
    gm = fx.GraphModule(torch.nn.Module(), g)
    order = grad_ready_order(gm, {0: "second", 1: "first"})
    assert [s.name for s in order] == ["first", "second"]


def test_bf16_gradients_are_reduced_in_fp32_when_asked():
    g, fake = fx.Graph(), FakeTensorMode()
    phs = []
    for name in ("a", "b"):
        ph = g.placeholder(name)
        ph.meta["val"] = fake.from_tensor(torch.empty(6, dtype=torch.bfloat16))
        phs.append(ph)
    g.output(tuple(phs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    ready = grad_ready_order(gm, {0: "a", 1: "b"})
    layout = plan_buckets(ready, bucket_mb=1.0, shards=2, reduce_dtype=torch.float32)
    insert_grad_sync(gm, SyncSpec(layout, {"a": 0, "b": 1}, group="dp", group_size=2, shard_rank=0))
    (rs,) = [n for n in gm.graph.nodes if is_collective(n)]
    assert rs.args[0].meta["val"].dtype == torch.float32
    assert gm.graph.output_node().args[0][2].meta["val"].dtype == torch.float32  # the fp32 shard


@pytest.mark.parametrize("average,scaled", [(True, True), (False, False)])
def test_average_scales_the_bucket_by_one_over_the_group_and_sum_does_not(average, scaled):
    gm = grads_graph({"a": (4,)})
    layout = plan_buckets(grad_ready_order(gm, {0: "a"}), bucket_mb=1.0, shards=4)
    insert_grad_sync(gm, SyncSpec(layout, {"a": 0}, group="dp", group_size=4, shard_rank=0, average=average))
    muls = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    assert [m.args[1] for m in muls] == ([0.25] if scaled else [])


def _two_tie_graph():
    shapes = {"a": (8,), "b": (8,)}
    gm = grads_graph(shapes)
    ready = grad_ready_order(gm, dict(enumerate(shapes)))
    ties = {"a": "0:a~1:a", "b": "0:b~1:b"}
    layout = plan_buckets(ready, bucket_mb=1.0, shards=2, ties=ties, align_ties=True)
    spec = SyncSpec(layout, {"a": 0, "b": 1}, group="dp", group_size=2, shard_rank=0,
                    tie_groups={"0:a~1:a": "tie", "0:b~1:b": "tie"})
    return insert_grad_sync(gm, spec)[0], layout


def test_verifier_proves_a_tie_all_reduce_meets_the_same_tie_on_every_member():
    gm, layout = _two_tie_graph()
    b, s = layout.locate("a")
    mine = TieLayout(0, "a", b.index, s.offset, s.numel, b.numel, 2)
    same = ["tie 0:a~1:a", "tie 0:b~1:b"]
    ok = verify_graph(gm, [TieCheck("0:a~1:a", "tie", ["a"], [mine], {0: same, 2: same})], rank=0)
    assert ok.ok
    # the other member issues the two ties the other way round: position 0 meets tie b there
    bad = verify_graph(gm, [TieCheck("0:a~1:a", "tie", ["a"], [mine], {0: same, 2: same[::-1]})], rank=0)
    assert not bad.ok
    assert "meets 'tie 0:b~1:b' on rank 2" in bad.hazards[0]


def test_verifier_on_dumps_catches_ties_met_in_different_orders(tmp_path):
    gm, layout = _two_tie_graph()
    dumps = []
    for rank, order in ((0, ["a", "b"]), (2, ["b", "a"])):
        ties = []
        for name in ("a", "b"):
            b, s = layout.locate(name)
            ties.append(TieCheck(f"0:{name}~1:{name}", "tie", [name],
                                 [TieLayout(rank, name, b.index, s.offset, s.numel, b.numel, 2)]))
        d = graph_to_json(gm, ties, rank)
        if order == ["b", "a"]:  # swap the two tie all-reduces' identities, as a rank issuing b first would
            tied = [n for n in d["nodes"] if n["group"] == "tie"]
            tied[0]["tag"]["identity"], tied[1]["tag"]["identity"] = tied[1]["tag"]["identity"], \
                tied[0]["tag"]["identity"]
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(d))
        dumps.append(d)
    assert verify_main([str(tmp_path)]) == 1


@pytest.mark.parametrize("first", [1.5, -0.0, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_ordering_dependence_leaves_its_value_bit_for_bit_whatever_the_node_it_waits_for_holds(first, dtype):
    """GraphBuilder.after (one reduce-scatter in flight, the gathers' prefetch) reads x through a zero made
    from another node: an overflow or NaN in the previous bucket must not leak into the next one."""
    from gradsched.passes.graph_utils import GraphBuilder
    g, fake = fx.Graph(), FakeTensorMode()
    x, node = g.placeholder("x"), g.placeholder("node")
    x.meta["val"] = fake.from_tensor(torch.empty(6, dtype=dtype))
    node.meta["val"] = fake.from_tensor(torch.empty(3, dtype=torch.float32))
    g.output(None)
    gm = fx.GraphModule(torch.nn.Module(), g)
    with g.inserting_before(g.output_node()):
        out = GraphBuilder(gm, fake).after(x, node)
    g.output_node().args = (out,)
    gm.recompile()
    xs = torch.tensor([1.0, -0.0, 0.0, float("inf"), -3.25, 1e-30], dtype=dtype)
    got = gm(xs, torch.tensor([first, 2.0, 3.0]))
    assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                              xs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_element_spreads_over_its_whole_bucket_before_the_reduce_scatter_and_a_finite_one_is_unchanged(bad):
    """spread_nonfinite: what the reduce-scatter reads is the bucket bit for bit, or NaN throughout when one element
    is not finite, so every rank's shard of it is NaN (each rank's own shards then flag any rank's gradients)."""
    gm = grads_graph({"a": (6,), "b": (4,)})
    layout = plan_buckets(grad_ready_order(gm, {0: "a", 1: "b"}), bucket_mb=1.0, shards=2)
    insert_grad_sync(gm, SyncSpec(layout, {"a": 0, "b": 1}, group="dp", group_size=2, shard_rank=0, average=False,
                                  spread_nonfinite=True))
    [rs] = [n for n in gm.graph.nodes if is_collective(n)]
    gm.graph.output_node().args = (rs.args[0],)  # what the reduce-scatter reads
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op == "output")  # the collectives too: unread now
    gm.recompile()
    a = torch.tensor([1.0, -0.0, 3e38, -3e38, 1e-40, 2.5])  # finite extremes: 0 x each is 0, no overflow
    b = torch.tensor([0.0, -7.0, 4.0, 1e-30])
    if bad is not None:
        b[2] = bad  # in the second half of the bucket: the other rank's shard
    got = gm(a, b)
    if bad is None:
        assert torch.equal(got.view(torch.int32), torch.cat([a, b]).view(torch.int32))
    else:
        assert torch.isnan(got).all()


@pytest.mark.parametrize("shard", [True, False])
def test_a_gradient_group_of_one_rank_issues_no_reduction_and_its_result_is_the_bucket(shard):
    gm = grads_graph({"a": (6,), "b": (4,)})
    layout = plan_buckets(grad_ready_order(gm, {0: "a", 1: "b"}), bucket_mb=1.0, shards=1)
    insert_grad_sync(gm, SyncSpec(layout, {"a": 0, "b": 1}, group="dp", group_size=1, shard_rank=0, shard=shard))
    assert not [n for n in gm.graph.nodes if is_collective(n)]
    a, b = torch.randn(6), torch.randn(4)
    out = gm(a, b)
    assert torch.equal(out[-1], torch.cat([a, b]))  # the bucket itself, unscaled (a group of one averages nothing)
    if not shard:  # each gradient handed back as its view of the bucket
        assert torch.equal(out[0], a) and torch.equal(out[1], b)
