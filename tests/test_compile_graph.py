"""compile_graph leaves the graph it is given as gradsched built it: the verifier, the report and
the cross-rank check read that graph after it is compiled."""
import pytest
import torch
import torch.distributed as dist

from gradsched.sync.compile import compile_graph
from gradsched.launch import free_port
from gradsched.passes import SyncSpec, grad_ready_order, insert_grad_sync, plan_buckets
from gradsched.passes.graph_utils import is_collective

from test_grad_sync_pass import STAGE1, grads_graph


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def collectives(gm):
    return [(n.name, n.target) for n in gm.graph.nodes if is_collective(n)]


def test_inductor_does_not_rewrite_the_graph_the_verifier_reads(world_of_one):
    # shard_aligned's tie all-reduce reads a whole-buffer view of the reduce-scatter's result, an
    # all_reduce Inductor's reinplacing turns into all_reduce_ (no longer a collective the verifier,
    # the report or the cross-rank check know) in the graph it compiles
    gm = grads_graph(STAGE1)
    layout = plan_buckets(grad_ready_order(gm, dict(enumerate(STAGE1))), bucket_mb=1.0, shards=1,
                          ties={"head": "t"}, align_ties=True)
    spec = SyncSpec(layout, {n: i for i, n in enumerate(STAGE1)}, group=world_of_one, group_size=1, shard_rank=0,
                    tie_groups={"t": world_of_one}, mode="shard_aligned")
    gm, _ = insert_grad_sync(gm, spec)
    before = collectives(gm)
    assert "_c10d_functional.all_reduce.default" in [str(t) for _, t in before]
    inputs = [torch.zeros(n.meta["val"].shape) for n in gm.graph.find_nodes(op="placeholder")]
    compile_graph(gm, inputs, "inductor")
    assert collectives(gm) == before


def test_ranks_compiling_one_graph_take_turns_and_other_graphs_do_not_wait(tmp_path, monkeypatch):
    """one_compile_per_host: a second compile of the same graph waits for the first (which then leaves its code in
    Inductor's cache); a compile of another graph does not. Each thread opens the lock file itself, as a rank does."""
    import threading
    import torch.fx as fx
    from gradsched.sync.compile import LOCKS_ENV, one_compile_per_host

    def graph(op):
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(op, (x,)))
        return fx.GraphModule(torch.nn.Module(), g)
    same, other, x = graph(torch.relu), graph(torch.sigmoid), [torch.zeros(2)]
    monkeypatch.setenv(LOCKS_ENV, str(tmp_path))
    events, first_in, release = [], threading.Event(), threading.Event()

    def compile_(name, gm, hold):
        with one_compile_per_host(gm, x):
            events.append(f"{name} in")
            if hold:
                first_in.set()
                release.wait(5)
            events.append(f"{name} out")
    first = threading.Thread(target=compile_, args=("first", same, True))
    first.start()
    assert first_in.wait(5)
    second = threading.Thread(target=compile_, args=("second", graph(torch.relu), False))  # the same code
    second.start()
    compile_("another", other, False)  # not blocked by the first's turn
    second.join(0.3)
    assert second.is_alive()  # still waiting for the first's turn
    release.set()
    first.join(5)
    second.join(5)
    assert events == ["first in", "another in", "another out", "first out", "second in", "second out"]
    monkeypatch.delenv(LOCKS_ENV)
    with one_compile_per_host(same, x):  # without the variable (torchrun, a cluster): nothing is taken
        pass
    assert len(list(tmp_path.iterdir())) == 2  # one lock file per distinct graph
