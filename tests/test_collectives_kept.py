"""Every rank's compiled ring issues the same collectives in the same graphs, each feeding its result.

One process, a fake process group (no peers, no data): the ring is compiled for each rank with
AOTAutograd and the min-cut partitioner, and each graph is read. In the plain layout with causal
attention the ranks do unequal work: rank 0 reads no other rank's K/V and, under a window, sends
back zero gradients. Without gradsched.cp.keep the partitioner moved rank 0's dK/dV all-to-all
into its forward graph (rank 1's stayed in its backward), and a collective whose result reaches no
output is what dead-code elimination may remove on one rank only: its peers then wait (a hang).
"""
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.testing._internal.distributed.fake_pg import FakeStore

from gradsched.cp.ring_attention import ring_attention
from gradsched.passes.graph_utils import COLLECTIVES


def compiled_for_rank(rank: int, call, world: int, compile_graph, decompositions=None) -> list:
    """compile_graph(gm, example_inputs) -> (callable, what to keep) for the forward and backward graphs of
    `call` on `rank` (a fake process group: no peers, no data); returns what it kept, in compile order."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        kept = []

        def compiler(gm, example_inputs):
            fn, keep = compile_graph(gm, example_inputs)
            kept.append(keep)
            return fn
        backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=decompositions,
                               partition_fn=min_cut_rematerialization_partition)
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: call(q, k, v, dist.group.WORLD.group_name), backend=backend,
                                 fullgraph=True)
        q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
        compiled(q, k, v).sum().backward()
        return kept
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def graphs_for_rank(rank: int, call, world: int = 2) -> list:
    return compiled_for_rank(rank, call, world, lambda gm, _: (gm.forward, gm))


def collectives_without_a_use(gm) -> list[str]:
    feeds = set()
    todo = [gm.graph.output_node()]
    while todo:
        n = todo.pop()
        if n not in feeds:
            feeds.add(n)
            todo.extend(n.all_input_nodes)
    return [n.name for n in gm.graph.nodes if n.target in COLLECTIVES and n not in feeds]


PLAIN_CAUSAL = {  # name -> (call, cp)
    "ring": (lambda q, k, v, g: ring_attention(q, k, v, g, causal=True, load_balance=False), 2),
    "ring_cp4": (lambda q, k, v, g: ring_attention(q, k, v, g, causal=True, load_balance=False), 4),
    "masked_ring_window": (lambda q, k, v, g: ring_attention(q, k, v, g, causal=True, load_balance=False, window=3), 2),
}


def collectives(gm) -> list[str]:
    return [COLLECTIVES[n.target] for n in gm.graph.nodes if n.target in COLLECTIVES]


@pytest.mark.parametrize("name", sorted(PLAIN_CAUSAL))
def test_every_rank_of_the_plain_layouts_causal_ring_compiles_the_same_collectives_each_with_a_use(name):
    call, cp = PLAIN_CAUSAL[name]
    per_rank = [graphs_for_rank(rank, call, cp) for rank in range(cp)]
    for graphs in per_rank:
        assert len(graphs) == 2  # forward, backward
        assert [collectives_without_a_use(gm) for gm in graphs] == [[], []]
    forward, backward = collectives(per_rank[0][0]), collectives(per_rank[0][1])
    assert forward and backward  # the backward rotates K/V again and sends dK/dV back: never merged into the forward
    assert all([collectives(gm) for gm in graphs] == [forward, backward] for graphs in per_rank), \
        [[collectives(gm) for gm in graphs] for graphs in per_rank]


def inductor_code_for_rank(rank: int, call, world: int) -> list:
    """(FX graph, Inductor's output code) of the forward and backward graphs of `call` on `rank`."""
    from torch._inductor.decomposition import select_decomp_table

    from gradsched.sync.compile import compile_graph

    def inductor(gm, example_inputs):
        fn = compile_graph(gm, example_inputs, "inductor")
        return fn, (gm, fn.source_code)
    return compiled_for_rank(rank, call, world, inductor, select_decomp_table())  # as gradsched's backend


CODE_NAMES = {"all_to_all_single": "all_to_all", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce", "all_reduce_": "all_reduce"}


def test_inductor_issues_every_ranks_ring_collectives_in_the_graphs_order():
    # the masked ring, where the ranks' work differs most: Inductor's generated code issues the same
    # collectives, in the FX graph's order, on every rank (the agreement's digest is read from the FX graph)
    from gradsched.sync.compiled_code import events
    call, cp = PLAIN_CAUSAL["masked_ring_window"]
    per_rank = []
    for rank in range(cp):
        issued = []
        for gm, code in inductor_code_for_rank(rank, call, cp):
            in_code = [CODE_NAMES[e.op] for e in events(code) if e.kind == "collective"]
            assert in_code == collectives(gm), (in_code, collectives(gm))
            issued.append(in_code)
        per_rank.append(issued)
    assert per_rank[0][0] and per_rank[0][1] and all(r == per_rank[0] for r in per_rank), per_rank
