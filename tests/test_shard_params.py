"""shard="params" (ZeRO-3 / FSDP): parameters live as each rank's shard of their bucket and are
all-gathered in the graphs just before use; training matches one process, gradient for gradient.

The training cases run on 4 gloo processes and are checked as tests/test_option_matrix.py checks
its rows (reduced gradients, every loss, every parameter, the verifier, tied copies bitwise equal).
"""
import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from gradsched.passes.graph_utils import GraphBuilder, c10d
from gradsched.passes.param_gather import GatherSpec, ParamSlot, expected_ready_order, gather_params
from test_graph_agreement import ancestors
from test_option_matrix import CLIP, assert_like_one_process, job, run_jobs, stage_of

CASES = {
    "params_pp1_dp4_m2_small_padded_buckets": job(1, 4, vocab=97, bucket_mb=0.004, microbatches=2, shard="params"),
    "params_pp2_dp2_tied_m2_clip": job(2, 2, microbatches=2, clip=CLIP, shard="params"),
    "params_pp2_dp2_adamw_param_groups": job(2, 2, optimizer="adamw", param_groups="decay_matrices", steps=3,
                                             shard="params"),
    "params_dp2_cp2": job(1, 2, 2, shard="params"),
    "params_pp1_dp4_no_reshard_after_forward": job(1, 4, bucket_mb=0.004, shard="params",
                                                   reshard_after_forward=False),
    # two stages a rank: each stage graph's forward lays out its own buckets as it compiles; in a V (the tie's copies
    # one Parameter on rank 0) and looped (the tie across the ranks), with B and W and without
    "params_pp2_dp2_zbv_adamw_m4": job(2, 2, schedule="zbv", layers=4, microbatches=4, optimizer="adamw", steps=3,
                                       shard="params"),
    "params_pp2_dp2_interleaved_1f1b_clip_m4": job(2, 2, schedule="interleaved_1f1b", layers=4, microbatches=4,
                                                   clip=CLIP, shard="params"),
    "params_pp2_dp2_dualpipev_small_buckets_m4": job(2, 2, schedule="dualpipev", layers=4, microbatches=4,
                                                     bucket_mb=0.004, shard="params"),
    "params_pp2_dp2_zb1p_no_reshard_clip_m4": job(2, 2, schedule="zb1p", microbatches=4, clip=CLIP, shard="params",
                                                  reshard_after_forward=False),  # the gathered view kept over B and W
    "params_pp2_dp2_zb1p_three_stages_a_rank_m4": job(2, 2, schedule="zb1p", stages_per_rank=3, layers=6,
                                                      microbatches=4, shard="params"),  # two stages reduce early
    "params_pp4_dualpipev_m8": job(4, 1, schedule="dualpipev", layers=8, microbatches=8, shard="params"),
    "params_pp2_cp2_dualpipev_clip_m4": job(2, 1, 2, schedule="dualpipev", layers=4, microbatches=4, clip=CLIP,
                                            shard="params"),  # the ring inside each of a rank's two stage graphs
    # under Inductor, small buckets: the option matrix's inductor_pp2_cp2_params_small_buckets_m4, and its looped and
    # DualPipeV rows (each row a cold compile)
}
TWO_RANKS = {  # a gradient group of one rank: its buckets' shard is the whole bucket
    "params_pp2_zbv_m4": job(2, 1, schedule="zbv", layers=4, microbatches=4, shard="params"),
    "params_pp2_dualpipev_m4": job(2, 1, schedule="dualpipev", layers=4, microbatches=4, shard="params"),
}
SEVERAL_STAGES = ("params_pp2_dp2_zbv_adamw_m4", "params_pp2_dp2_interleaved_1f1b_clip_m4",
                  "params_pp2_dp2_dualpipev_small_buckets_m4", "params_pp2_cp2_dualpipev_clip_m4")


@pytest.fixture(scope="module")
def runs():
    return {**run_jobs(CASES), **run_jobs(TWO_RANKS, world=2)}


@pytest.mark.parametrize("name", list(CASES) + list(TWO_RANKS))
def test_sharded_parameters_train_like_one_process(name, runs):
    assert_like_one_process({**CASES, **TWO_RANKS}[name], runs[name])


@pytest.mark.parametrize("name", SEVERAL_STAGES)
def test_with_two_stages_a_rank_each_bucket_holds_one_stages_parameters_and_none_is_whole(name, runs):
    for r in runs[name]:
        assert r["param_storage_bytes"] == 0
        whole = sum(v.numel() * v.element_size() for v in r["params"].values())
        assert whole / 2 <= r["param_shard_bytes"] <= 1.15 * whole / 2
        stages = [{stage_of(r["split_points"], n) for n in names} for names in r["bucket_params"]]
        assert all(len(s) == 1 for s in stages), stages  # a stage gathers its own buckets, not the other's
        assert len({s for [s] in stages}) == 2  # both of the rank's stages


def test_each_rank_holds_its_shard_of_the_parameters_and_no_whole_one(runs):
    for r in runs["params_pp1_dp4_m2_small_padded_buckets"]:
        whole = sum(v.numel() * v.element_size() for v in r["params"].values())
        assert r["param_storage_bytes"] == 0  # the parameters' own storage is released
        assert whole / 4 <= r["param_shard_bytes"] <= 1.15 * whole / 4  # a quarter, plus bucket padding


def graph_of_three_linears():
    """x @ w0 @ w1 @ w2, each weight a placeholder (as AOTAutograd's forward graph takes parameters)."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    b = GraphBuilder(gm, FakeTensorMode())
    x = b.placeholder("x", [2, 4], torch.float32, torch.device("cpu"))
    ws = [b.placeholder(f"w{i}", [4, 4], torch.float32, torch.device("cpu")) for i in range(3)]
    h = x
    for w in ws:
        h = b.call(torch.ops.aten.mm.default, h, w)
    gm.graph.output((h, ws[2]))  # w2 saved for the backward, as a forward graph does
    gm.recompile()
    return gm


def spec(keep: bool) -> GatherSpec:  # one weight per bucket, 2 ranks
    return GatherSpec({f"w{i}": ParamSlot(i, 0, 16, (4, 4), torch.float32) for i in range(3)},
                      {i: 8 for i in range(3)}, {i: torch.float32 for i in range(3)}, "dp", 2, keep)


def test_each_bucket_is_gathered_before_use_and_one_bucket_ahead_not_more():
    gm, record = gather_params(graph_of_three_linears(), spec(keep=True))
    assert record.buckets == (0, 1, 2) and record.kept == ()
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(gathers) == 3
    for k in range(3):
        assert gathers[k] in ancestors(mms[k])  # the matmul reads the gathered bucket
    assert mms[0] in ancestors(gathers[1]) and mms[1] in ancestors(gathers[2])  # prefetch: after the previous use
    assert mms[1] not in ancestors(gathers[1]) and mms[2] not in ancestors(gathers[2])  # ... not after its own
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    assert not phs["w0"].users and not phs["w1"].users  # no whole parameter is read
    assert list(phs["w2"].users) == [gm.graph.output_node()]  # kept as the saved value: the backward gathers again


def test_without_resharding_the_saved_parameter_is_the_gathered_view():
    gm, record = gather_params(graph_of_three_linears(), spec(keep=False))
    assert len(record.kept) == 1  # the forward's output keeps bucket 2 gathered for the backward
    assert not [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("w") and n.users]


def test_gradients_are_expected_ready_in_the_reverse_order_of_first_use():
    gm = graph_of_three_linears()
    order = expected_ready_order(gm, {f"w{i}": (f"p{i}", (4, 4), torch.float32) for i in range(3)})
    assert [g.name for g in order] == ["p2", "p1", "p0"]


def test_a_node_reading_two_buckets_first_chains_the_second_gather_to_the_first_bucket():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    b = GraphBuilder(gm, FakeTensorMode())
    ws = [b.placeholder(f"w{i}", [4, 4], torch.float32, torch.device("cpu")) for i in range(2)]
    gm.graph.output((b.call(torch.ops.aten.add.Tensor, ws[0], ws[1]),))  # one node, the first use of both
    gm.recompile()
    gm, record = gather_params(gm, spec(keep=True))
    gm.graph.lint()  # every node defined before it is read
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert record.buckets == (0, 1) and gathers[0] in ancestors(gathers[1])


def test_a_bucket_first_used_by_a_node_of_several_outputs_still_chains_the_next_gather():
    """A split (a list of tensors) as a bucket's first use, as Gemma's graphs have: the next bucket's gather
    follows the first tensor computed from it (it raised KeyError on a node the pass had inserted)."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    b = GraphBuilder(gm, FakeTensorMode())
    x = b.placeholder("x", [2, 4], torch.float32, torch.device("cpu"))
    ws = [b.placeholder(f"w{i}", [4, 4], torch.float32, torch.device("cpu")) for i in range(3)]
    halves = b.call(torch.ops.aten.split.Tensor, ws[0], 2)
    h = b.call(torch.ops.aten.mm.default, x, b.call(torch.ops.aten.cat.default, [b.call(operator.getitem, halves, 0),
                                                                                 b.call(operator.getitem, halves, 1)]))
    for w in ws[1:]:
        h = b.call(torch.ops.aten.mm.default, h, w)
    gm.graph.output((h,))
    gm.recompile()
    gm, record = gather_params(gm, spec(keep=True))
    gm.graph.lint()
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    first_half = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert record.buckets == (0, 1, 2) and first_half in ancestors(gathers[1])


def test_parallelize_refuses_sharded_parameters_with_graph_breaks():
    from gradsched.launch import run_ranks
    from rank_fns import parallelize_refusal
    [msg] = run_ranks(parallelize_refusal, 1, {"shard": "params", "fullgraph": False})
    assert msg.startswith("ValueError: shard='params' needs fullgraph=True")


def test_bf16_sharded_parameters_are_their_fp32_masters_rounded_and_gathered_as_such():
    from gradsched.launch import run_ranks
    from rank_fns import bf16_parameters_sharded
    for r in run_ranks(bf16_parameters_sharded, 2):
        assert r["exact"]
        assert abs(r["loss"] - r["copy_loss"]) <= 2e-2 * abs(r["copy_loss"])  # bf16 kernels, two programs
        assert r["state_dict_warnings"] == []  # torch's current collective names: no deprecation warning


def test_a_weights_transpose_computed_at_the_graphs_top_does_not_gather_its_bucket_there():
    # AOTAutograd's backward computes every weight's transpose first; the gather must wait for the use
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    b = GraphBuilder(gm, FakeTensorMode())
    x = b.placeholder("x", [2, 4], torch.float32, torch.device("cpu"))
    ws = [b.placeholder(f"w{i}", [4, 4], torch.float32, torch.device("cpu")) for i in range(2)]
    transposes = [b.call(torch.ops.aten.t.default, w) for w in ws]  # both at the top
    h = x
    for t in transposes:
        h = b.call(torch.ops.aten.relu.default, b.call(torch.ops.aten.mm.default, h, t))
    gm.graph.output((h,))
    gm.recompile()
    gm, _ = gather_params(gm, spec(keep=False))
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    first_mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert first_mm in ancestors(gathers[1])  # bucket 1 is gathered after bucket 0 is used, not at the top
    order = list(gm.graph.nodes)
    assert order.index(gathers[1]) > order.index(first_mm)  # and stands there in the graph (eager runs it so)


def test_a_later_stage_graphs_parameters_join_the_ranks_shards_as_own_buckets_and_leave_with_a_failed_compile():
    """Several stages a rank: shard_more appends the new parameters' buckets (indices continuing, the first graph's
    buckets unchanged, a parameter laid out already not again); a compile that fails takes its buckets back."""
    from gradsched.options import SyncOptions
    from gradsched.sync.param_shards import shard_more, shard_parameters
    gm = graph_of_three_linears()
    params = {f"w{i}": torch.full((4, 4), float(i + 1)) for i in range(3)}
    options = SyncOptions(bucket_mb=1e-5)  # one weight a bucket
    shards = shard_parameters(gm, {"w0": "w0"}, params, options, 1, 2, {})
    first = (shards.layout.buckets, dict(shards.shards))
    shard_more(shards, gm, {"w0": "w0", "w1": "w1", "w2": "w2"}, params, options, {})
    assert [b.index for b in shards.layout.buckets] == [0, 1, 2] and shards.layout.buckets[0] == first[0][0]
    assert shards.shards[0] is first[1][0] and sorted(shards.params) == ["w0", "w1", "w2"]
    assert [s.name for b in shards.layout.buckets for s in b.slots].count("w0") == 1
    for name, value in (("w1", 2.0), ("w2", 3.0)):  # rank 1's half of each (ready order: w2's bucket first)
        assert torch.equal(shards.shards[shards.layout.locate(name)[0].index], torch.full((8,), value))
    shards.forget_after(1)
    assert len(shards.layout.buckets) == 1 and list(shards.shards) == [0] and list(shards.params) == ["w0"]
    assert len(shards.dtypes) == 1
