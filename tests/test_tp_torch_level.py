"""passes/tp_torch_level.py: an exported (aten-level) graph respelled torch-level computes what it computed."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradsched.passes.tp_torch_level import SPELLINGS, torch_level


class EveryRespelledOp(nn.Module):
    """Ops export writes in a pipeline stage of our models (HF Llama, GPT-2, the tiny GPT)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.norm = nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.conv_w, self.conv_b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))

    def forward(self, ids):
        x = self.emb(ids).to(torch.float32)  # to.dtype and its metadata assertion
        x = self.norm(self.lin(x))
        h = x.view(2, 4, 2, 4).permute(0, 2, 1, 3).contiguous()  # permute, clone(memory_format)
        half = torch.cat([-h[:, :, :, 2:], h[:, :, :, :2]], dim=-1)  # slice, neg, cat
        y = F.dropout(half.transpose(1, 2).reshape(2, 4, 8), 0.0, True)  # dropout (p=0, training)
        y = torch.addmm(self.conv_b, y.view(-1, 8), self.conv_w)  # GPT-2's Conv1D
        return F.gelu(y).sum(-1, keepdim=True), ids


def test_an_exported_graph_respelled_torch_level_computes_what_it_computed():
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 4))
    gm = torch.export.export(EveryRespelledOp(), (ids,)).module()
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):  # what export writes where a stage returns its input
        alias = gm.graph.call_function(torch.ops.aten.alias.default, (out.args[0][1],))
    out.args = ((out.args[0][0], alias), *out.args[1:])
    gm.recompile()
    before = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert before & set(SPELLINGS), before  # the graph is aten-level, as a pipeline stage's
    want = gm(ids)
    respelled, count = torch_level(copy.deepcopy(gm))
    left = {n.target for n in respelled.graph.nodes if n.op == "call_function"} & set(SPELLINGS)
    assert count and not left, left
    dropped = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.alias.default)
    assert not [n for n in respelled.graph.nodes if n.target in dropped]
    got = respelled(ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)


def _attention_graph(read_lse: bool) -> torch.fx.GraphModule:
    """q, k, v -> the CPU flash kernel (as a graph traced for a device holds it), its output read (and its LSE)."""
    import operator
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    call = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True),
                           {"scale": 0.5})
    out = g.call_function(operator.getitem, (call, 0))
    g.call_function(operator.getitem, (call, 1))  # a piece of the tuple nothing reads, as a traced body takes it
    lse = g.call_function(operator.getitem, (call, 1)) if read_lse else None
    g.output((out, lse) if read_lse else (out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_fused_attention_kernel_whose_output_alone_is_read_becomes_sdpa_shaped_bitwise():
    """FUSED_ATTENTION: the kernel's call becomes a function of SDPA's arguments (which the TP pass splits by heads,
    tp_roles.is_sdpa) computing the same bits; the unread pieces of its tuple are gone."""
    from gradsched.passes import tp_roles
    from gradsched.passes.tp_torch_level import cpu_flash_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=torch.float64) for _ in range(3))
    gm = _attention_graph(read_lse=False)
    want = gm(q, k, v)
    respelled, count = torch_level(copy.deepcopy(gm))
    calls = [n for n in respelled.graph.nodes if n.op == "call_function"]
    assert count == 1 and [n.target for n in calls] == [cpu_flash_attention], calls
    assert tp_roles.is_sdpa(calls[0]) and calls[0].kwargs["is_causal"] is True and calls[0].kwargs["scale"] == 0.5
    assert torch.equal(respelled(q, k, v)[0], want[0])


def test_a_fused_attention_kernel_whose_logsumexp_is_read_is_left_as_it_is():
    """Its LSE is not SDPA's: respelling it would drop a value the graph reads."""
    gm = _attention_graph(read_lse=True)
    respelled, count = torch_level(copy.deepcopy(gm))
    assert count == 0
    assert [n.target for n in respelled.graph.nodes if n.op == "call_function"][0] is \
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
