"""sink_waits: each wait stands just before its first use; collectives keep their order."""
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from gradsched.passes.graph_utils import GraphBuilder, is_collective
from gradsched.passes.sink_waits import WAIT, sink_waits


def backward_like_graph():
    """a -> reduce a; b = a @ a (independent compute); c -> reduce c; out = (wait_a + 1, b, wait_c)."""
    g, fake = fx.Graph(), FakeTensorMode()
    a, c = g.placeholder("a"), g.placeholder("c")
    for ph in (a, c):
        ph.meta["val"] = fake.from_tensor(torch.empty(8, 8))
    g.output(())
    gm = fx.GraphModule(torch.nn.Module(), g)
    bld = GraphBuilder(gm, fake)
    with g.inserting_before(g.output_node()):
        wa = bld.collective("all_reduce", bld.call(torch.ops.aten.reshape.default, a, [-1]), "dp", 2, {"id": "a"})
        b = bld.call(torch.ops.aten.mm.default, a, a)
        wc = bld.collective("reduce_scatter", bld.call(torch.ops.aten.reshape.default, c, [-1]), "dp", 2, {"id": "c"})
        use = bld.call(torch.ops.aten.add.Tensor, wa, 1.0)
    g.output_node().args = ((use, b, wc),)
    gm.recompile()
    return gm


def names(gm, pred):
    return [n.name for n in gm.graph.nodes if pred(n)]


def test_each_wait_moves_to_just_before_its_first_user():
    gm, record = sink_waits(backward_like_graph())
    for w in gm.graph.find_nodes(op="call_function", target=WAIT):
        first = min(w.users, key=list(gm.graph.nodes).index)
        assert w.next is first
    assert len(record.moved) == 2


def test_collectives_keep_their_order_and_compute_runs_while_they_are_in_flight():
    before = backward_like_graph()
    order = names(before, is_collective)
    gm, _ = sink_waits(before)
    assert names(gm, is_collective) == order
    nodes = list(gm.graph.nodes)
    mm = next(n for n in nodes if n.target == torch.ops.aten.mm.default)
    first_collective = next(n for n in nodes if is_collective(n))
    waits = list(gm.graph.find_nodes(op="call_function", target=WAIT))
    assert nodes.index(first_collective) < nodes.index(mm) < min(nodes.index(w) for w in waits)


def test_a_wait_already_before_its_user_is_left_alone():
    gm, _ = sink_waits(backward_like_graph())
    again, record = sink_waits(gm)
    assert record.moved == ()
