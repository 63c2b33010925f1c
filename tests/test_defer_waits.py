"""defer_waits: a graph returns its reductions in flight, their inputs kept alive; waits read inside stay."""
import torch

from gradsched.passes.defer_waits import WAIT, defer_waits
from gradsched.passes.graph_utils import is_collective
from test_sink_waits import backward_like_graph


def test_a_reduction_only_the_output_reads_is_returned_unwaited_with_its_input_kept():
    gm, record = defer_waits(backward_like_graph())  # outputs: (wait_a + 1, a @ a, wait_c)
    out = list(gm.graph.output_node().args[0])
    collectives = [n for n in gm.graph.nodes if is_collective(n)]
    assert record.deferred == (2,) and out[2] is collectives[1]  # c's reduction itself, not its wait
    assert record.kept == 1 and out[3] is collectives[1].args[0]  # ... and the tensor it reads
    waits = gm.graph.find_nodes(op="call_function", target=WAIT)
    assert [w.args[0] for w in waits] == [collectives[0]]  # a's result is read in the graph: its wait stays


def test_collectives_keep_their_order():
    before = [n.name for n in backward_like_graph().graph.nodes if is_collective(n)]
    gm, _ = defer_waits(backward_like_graph())
    assert [n.name for n in gm.graph.nodes if is_collective(n)] == before


def test_after_the_agreement_the_kept_input_is_the_one_the_reduction_reads():
    import gradsched.sync.agreement_check  # noqa: F401 - registers gradsched::agree
    from gradsched.passes.agreement import AgreementSpec, insert_agreement
    gm, _ = insert_agreement(backward_like_graph(), AgreementSpec(torch.ops.gradsched.agree.default, {"dp": 2}))
    gm, record = defer_waits(gm)
    out = list(gm.graph.output_node().args[0])
    reduction = out[record.deferred[0]]
    kept = out[len(out) - record.kept:]
    assert reduction.args[0].target is torch.ops.aten.sub.Tensor and kept == [reduction.args[0]]  # minus the zero
