"""Every compiled graph agrees with its peers' graphs on each group's collectives before issuing any,
on every run: ranks that would run different collectives raise, naming both sides; a recompile on
some ranks only runs on when its collectives are the same (gradsched.sync.agreement_check)."""
import time

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import gradsched.sync.agreement_check  # noqa: F401 - registers gradsched::agree
from gradsched.launch import RankFailed, run_ranks
from gradsched.passes.agreement import AgreementSpec, collective_sequences, digest, insert_agreement
from gradsched.passes.graph_utils import GraphBuilder, c10d, collective_group, is_collective
from tied_training import Job, abs_diff, rank_main
from tiny_gpt import TinyGPT, lm_loss, make_batch

from rank_fns import recompile_on_one_rank, swapped_graphs_after_warm_up, uneven_batches

AGREE = torch.ops.gradsched.agree.default


def tie_then_reduce_scatter(numel: int = 8) -> fx.GraphModule:
    """x -> all-reduce over "tie" -> reduce-scatter over "dp" (what a tied bucket's sync graph does),
    and an independent all-reduce of y over "dp"."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    b = GraphBuilder(gm, FakeTensorMode())
    x = b.placeholder("x", [numel], torch.float32, torch.device("cpu"))
    y = b.placeholder("y", [4], torch.float32, torch.device("cpu"))
    tied = b.collective("all_reduce", x, "tie", 2, {"identity": "tie wte"})
    shard = b.collective("reduce_scatter", tied, "dp", 2, {"identity": [["wte", 0, numel]]})
    other = b.collective("all_reduce", b.call(torch.ops.aten.mul.Tensor, y, 2.0), "dp", 2, {"identity": "y"})
    gm.graph.output((shard, other))
    gm.recompile()
    return gm


def ancestors(n: fx.Node) -> set:
    seen, todo = set(), list(n.all_input_nodes)
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo.extend(a.all_input_nodes)
    return seen


def test_every_collective_of_a_group_reads_its_groups_agreement_and_the_graph_computes_the_same():
    gm = tie_then_reduce_scatter()
    before = collective_sequences(gm)
    _, record = insert_agreement(gm, AgreementSpec(AGREE, {"tie": 2, "dp": 2}))
    agrees = {n.args[2]: n for n in gm.graph.nodes if n.target is AGREE}
    assert set(agrees) == {"tie", "dp"} and set(record.digests) == {"tie", "dp"}
    gathers = {n for n in gm.graph.nodes if is_collective(n) and n.args[0].target is torch.ops.aten.full.default}
    for n in gm.graph.nodes:
        if is_collective(n) and n not in gathers:
            assert agrees[collective_group(n)] in ancestors(n), n  # no compiler can issue it before the check
    # the reduce-scatter still reads the all-reduced buffer itself: its zero went in before the all-reduce
    rs = next(n for n in gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default)
    assert rs.args[0].target is c10d.wait_tensor.default and rs.args[0].args[0].target is c10d.all_reduce.default
    # the agreements' own all-gathers come first; the sequences the digests name are the graph's own
    first = [n for n in gm.graph.nodes if is_collective(n)][:2]
    assert [n.target for n in first] == [c10d.all_gather_into_tensor.default] * 2
    assert record.sequences == before and record.digests == {g: digest(s) for g, s in before.items()}
    for n in gm.graph.nodes:
        assert n.op in ("placeholder", "output") or "val" in n.meta, n


def test_the_digests_all_gathers_are_issued_before_the_graph_computes_and_waited_for_before_its_first_collective():
    # a backward's shape: compute first, then its reductions
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    b = GraphBuilder(gm, FakeTensorMode())
    x = b.placeholder("x", [8], torch.float32, torch.device("cpu"))
    grad = b.call(torch.ops.aten.mul.Tensor, x, 2.0)
    tied = b.collective("all_reduce", grad, "tie", 2, {"identity": "tie wte"})
    gm.graph.output((b.collective("reduce_scatter", tied, "dp", 2, {"identity": [["wte", 0, 8]]}),))
    gm.recompile()
    insert_agreement(gm, AgreementSpec(AGREE, {"tie": 2, "dp": 2}))
    order = list(gm.graph.nodes)
    gathers = [n for n in order if n.target is c10d.all_gather_into_tensor.default]
    mul = next(n for n in order if n.target is torch.ops.aten.mul.Tensor and n.args[0] is x)  # the graph's compute
    assert len(gathers) == 2 and all(order.index(g) < order.index(mul) for g in gathers)  # latency hidden behind it
    first = next(n for n in order if is_collective(n) and n not in gathers)
    waits = [u for g in gathers for u in g.users if u.target is c10d.wait_tensor.default]
    assert len(waits) == 2 and all(order.index(w) < order.index(first) for w in waits)


def test_a_sequence_differing_in_one_size_has_another_digest():
    same, other = collective_sequences(tie_then_reduce_scatter()), collective_sequences(tie_then_reduce_scatter(16))
    assert digest(same["dp"]) == digest(collective_sequences(tie_then_reduce_scatter())["dp"])
    assert digest(same["dp"]) != digest(other["dp"]) and 0 < digest(same["dp"]) < 2 ** 62


def test_a_recompile_on_one_rank_only_with_the_same_collectives_runs_on():
    ranks = run_ranks(recompile_on_one_rank, 2, False, timeout_s=240)
    expected = 2 * (2 * torch.arange(4.0) + 1)  # 2 * (x_0 + x_1), x_r = arange + r
    for r in ranks:
        assert r["error"] is None
        assert all(torch.equal(o, expected) for o in r["outputs"])


def test_a_recompile_on_one_rank_only_with_other_collectives_raises_on_both_ranks_naming_both_graphs():
    # without the agreement rank 0 finishes and rank 1 waits in its extra all-reduce until gloo's timeout
    t0 = time.monotonic()
    ranks = run_ranks(recompile_on_one_rank, 2, True, timeout_s=240, collective_timeout_s=600)
    assert time.monotonic() - t0 < 120  # far below the collective timeout: nobody waited for it
    for me, other, mine, theirs in ((0, 1, "graph A", "graph C"), (1, 0, "graph C", "graph A")):
        msg = ranks[me]["error"]
        assert msg.startswith("CollectiveMismatch"), msg
        assert f"this rank ({me}) runs {mine}, " in msg and f"rank {other} runs {theirs}, " in msg
        assert "1 collective(s)" in msg and "2 collective(s)" in msg
        assert "at collective #1" in msg.lower()
        assert len(ranks[me]["outputs"]) == 1  # step 0 ran; step 1 issued nothing on the group


def test_after_warm_up_ranks_running_different_graphs_get_nan_and_raise_at_the_steps_end_naming_both():
    # both graphs ran before on every rank, so neither run reads the digests: nothing fails while they run (the
    # same sizes), the results are NaN instead of a silent mix, and the step's end raises on both ranks
    ranks = run_ranks(swapped_graphs_after_warm_up, 2, timeout_s=120)
    for me, other, mine, theirs in ((0, 1, "graph A", "graph B"), (1, 0, "graph B", "graph A")):
        r = ranks[me]
        assert torch.isnan(r["output"]).all(), r["output"]
        assert r["error"].startswith("CollectiveMismatch: ranks [0, 1] ran different collectives"), r["error"]
        assert f"this rank ({me}) runs {mine}, " in r["error"] and f"rank {other} runs {theirs}, " in r["error"]
        assert "nothing computed from them was applied" in r["error"]


def test_context_parallel_ranks_compiling_different_attention_raise_before_any_ring_collective():
    # rank 1 lowers attention to an all-to-all (Ulysses), rank 0 to a ring: without the agreement one
    # rank crashes inside gloo and the other only learns that its peer is gone
    job = Job(pp=1, dp=1, cp=2, steps=1, options={"compiler": "eager"}, rank_options={1: {"comm": "a2a"}})
    with pytest.raises(RankFailed) as err:
        run_ranks(rank_main, 2, job, timeout_s=240)
    msg = str(err.value)
    assert msg.count("CollectiveMismatch: ranks [0, 1] are about to run different collectives") >= 2
    assert "this rank (0) runs the forward graph of stage 0" in msg
    assert "this rank (1) runs the forward graph of stage 0" in msg
    assert "At collective #0 rank 0 issues all_to_all" in msg and "but rank 1 issues all_to_all" in msg


def one_process_uneven(job: Job, batches: list) -> dict:
    """Each step's gradient is the mean over ranks of each rank's mean loss (what data parallel with
    average=True computes), in one process."""
    torch.manual_seed(job.seed)
    model = TinyGPT(job.config)
    opt = torch.optim.SGD(model.parameters(), lr=job.lr)
    for step, sizes in enumerate(batches):
        x, y = make_batch(sum(sizes), job.config, seed=job.seed + 1 + step)
        bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
        loss = sum(lm_loss(model(x[a:b]), y[a:b]) for a, b in zip(bounds, bounds[1:])) / len(sizes)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_data_parallel_training_with_a_recompile_on_one_rank_only_matches_one_process():
    job = Job(pp=1, dp=2, lr=0.5, options={"compiler": "inductor"})
    batches = [(4, 4), (4, 3), (4, 3)]  # step 1: rank 1 alone sees a new batch size and recompiles
    ranks = run_ranks(uneven_batches, 2, job, batches, timeout_s=400)
    ref = one_process_uneven(job, batches)
    assert [r["graphs_compiled"] for r in ranks] == [1, 2]  # rank 1 compiled a second graph, rank 0 did not
    for r in ranks:
        assert r["sync_runs"] == 3
        assert max(abs_diff(r["params"][n], p) for n, p in ref.items()) < 1e-5
