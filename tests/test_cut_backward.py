"""passes/cut_backward.py: a compiled backward graph cut into B (input gradients) and W (weight
gradients) computes what the whole graph did, each node once, and B only what the input gradients need.

The graphs are AOTAutograd's own backward graphs of pipeline stages of the tiny tied GPT, captured with
their real inputs; the reference is the uncut graph run on those inputs, and eager autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

from gradsched.backend import parameter_inputs
from gradsched.passes.cut_backward import CutSpec, cut_backward
from gradsched.sync.compile import compile_graph
from tiny_gpt import Block, GPTConfig, TinyGPT


class Middle(nn.Module):  # a middle stage: hidden states in (they need a gradient), hidden states out
    def __init__(self, c):
        super().__init__()
        self.blocks = nn.Sequential(Block(c), Block(c))

    def forward(self, x):
        return self.blocks(x)


def captured_backward(module, *inputs):
    """(backward graph, its real inputs, {weight-gradient output position: parameter name})."""
    got = {}

    def fw(gm, _):
        return make_boxed_func(gm.forward)

    def bw(gm, _):
        got["gm"] = gm

        def run(*args):  # a copy of what the graph is given (AOTAutograd frees its boxed inputs)
            got["args"] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            return gm(*args)
        return make_boxed_func(run)

    def backend(gm, example_inputs):
        got["params"] = parameter_inputs(gm, example_inputs)
        return aot_autograd(fw_compiler=fw, bw_compiler=bw, decompositions=select_decomp_table(),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    gm = got["gm"]
    descs = gm.graph.output_node().meta["desc"]
    of = [getattr(getattr(d, "grad_of", None), "idx", None) for d in descs]
    return gm, got["args"], {i: got["params"][k][0] for i, k in enumerate(of) if k in got["params"]}


def stages():
    torch.manual_seed(0)
    c = GPTConfig()
    x = torch.randn(2, c.seq, c.dim, requires_grad=True)
    tokens = torch.randint(0, c.vocab, (2, c.seq))
    return {"middle": (Middle(c), (x,)), "whole_tied_model": (TinyGPT(c), (tokens,))}


def run_cut(gm, args, weights):
    b, rec = cut_backward(gm, CutSpec(frozenset(weights)))
    b_out = b(*(args[i] for i in rec.b_inputs))
    n_in = len(rec.input_outputs)
    w_out = rec.w(*b_out[n_in:], *(args[i] for i in rec.w_inputs))
    out = [None] * (len(rec.input_outputs) + len(rec.weight_outputs))
    for i, v in zip(rec.input_outputs, b_out[:n_in]):
        out[i] = v
    for i, v in zip(rec.weight_outputs, w_out):
        out[i] = v
    return out, rec


@pytest.mark.parametrize("stage", ["middle", "whole_tied_model"])
def test_b_then_w_gives_every_gradient_the_whole_graph_gives_bitwise(stage):
    module, inputs = stages()[stage]
    gm, args, weights = captured_backward(module, *inputs)
    assert weights, "the stage's weights have gradients"
    want = gm(*args)
    got, _ = run_cut(gm, args, weights)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert torch.equal(g, w), (g - w).abs().max()


def test_b_then_w_match_eager_autograd():
    module, (x,) = stages()["middle"]
    gm, args, weights = captured_backward(module, x)
    got, rec = run_cut(gm, args, weights)
    x2 = x.detach().clone().requires_grad_()
    module.zero_grad()
    out = module(x2)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    (dx,) = [got[i] for i in rec.input_outputs if got[i] is not None]
    scale = x2.grad.abs().max()
    assert ((dx - x2.grad).abs().max() / scale).item() < 1e-6
    params = dict(module.named_parameters())
    assert sorted(weights.values()) == sorted(params)
    for i in rec.weight_outputs:
        g, p = got[i], params[weights[i]]
        assert ((g - p.grad).abs().max() / p.grad.abs().max()).item() < 1e-5


@pytest.mark.parametrize("stage", ["middle", "whole_tied_model"])
def test_every_node_runs_once_and_b_holds_only_what_the_input_gradients_need(stage):
    module, inputs = stages()[stage]
    gm, args, weights = captured_backward(module, *inputs)
    _, rec = run_cut(gm, args, weights)
    whole = sum(n.op == "call_function" for n in gm.graph.nodes)
    assert rec.b_nodes + rec.w_nodes == whole
    b_outputs = rec.b.graph.output_node().args[0][:len(rec.input_outputs)]
    needed, todo = set(), [o for o in b_outputs if isinstance(o, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    assert {n for n in rec.b.graph.nodes if n.op == "call_function"} <= needed
    if stage == "middle":  # each Linear's weight gradient (an mm with the saved input) is W's work
        assert rec.w_nodes > 0 and rec.b_nodes < whole
    else:  # token inputs have no gradient: every node is the weights'
        assert rec.b_nodes == 0 and rec.w_nodes == whole
    for g in (rec.b, rec.w):
        assert all("val" in n.meta for n in g.graph.nodes if n.op in ("placeholder", "call_function"))


def test_both_halves_compile_with_inductor_and_agree_with_the_whole_graph():
    module, inputs = stages()["middle"]
    gm, args, weights = captured_backward(module, *inputs)
    want = gm(*args)
    b, rec = cut_backward(gm, CutSpec(frozenset(weights)))
    b_args = [args[i] for i in rec.b_inputs]
    b_out = compile_graph(b, b_args, "inductor")(b_args)
    n_in = len(rec.input_outputs)
    w_args = [*b_out[n_in:], *(args[i] for i in rec.w_inputs)]
    w_out = compile_graph(rec.w, w_args, "inductor")(list(w_args))
    for i, v in [*zip(rec.input_outputs, b_out[:n_in]), *zip(rec.weight_outputs, w_out)]:
        if want[i] is not None:
            assert ((v - want[i]).abs().max() / want[i].abs().max()).item() < 1e-5


def test_a_weight_position_outside_the_outputs_is_refused():
    module, inputs = stages()["middle"]
    gm, _, _ = captured_backward(module, *inputs)
    with pytest.raises(ValueError, match="outside the graph's"):
        cut_backward(gm, CutSpec(frozenset({10_000})))


@pytest.mark.parametrize("stage", ["middle", "whole_tied_model"])
def test_b_takes_only_the_inputs_it_reads_and_w_may_take_the_rest_later(stage):
    module, inputs = stages()[stage]
    gm, args, weights = captured_backward(module, *inputs)
    _, rec = run_cut(gm, args, weights)
    for ph in rec.b.graph.find_nodes(op="placeholder"):  # every input B is given, B reads (or returns)
        assert ph.users, ph.name
    if stage == "middle":  # a Linear's saved input feeds its weight gradient only: W's, not B's
        assert set(rec.w_inputs) - set(rec.b_inputs)
