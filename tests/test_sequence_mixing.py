"""Under context parallelism nothing mixes tokens locally by accident: each form is lowered or refused."""
import torch
import torch.nn as nn

from gradsched.launch import run_ranks
from gradsched.passes.sequence_mixing import unlowered_sequence_mixing
from tiny_gpt import GPTConfig, TinyGPT

from flash_attn_standin import flash_attn_func
from rank_fns import flash_attn_model_under_cp

SEQ = 8


def dynamo_graph(model, *inputs):
    """The torch-level graph Dynamo hands a backend (what the CP lowering sees)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    return graphs[0]


def tokens():
    return torch.randint(0, 64, (2, SEQ))


class FlashAttnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.qkv = nn.Embedding(64, 32), nn.Linear(32, 96)

    def forward(self, idx):
        q, k, v = self.qkv(self.emb(idx)).view(2, SEQ, 3, 4, 8).unbind(2)
        return flash_attn_func(q, k, v, causal=True)


class Cumulative(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)

    def forward(self, idx):
        return self.emb(idx).cumsum(dim=1)


class SequenceConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.conv = nn.Embedding(64, 32), nn.Conv1d(32, 32, 3, padding=1)

    def forward(self, idx):
        return self.conv(self.emb(idx).transpose(1, 2))


def test_flash_attn_traced_into_by_dynamo_is_found_inside_its_autograd_function():
    found = unlowered_sequence_mixing(dynamo_graph(FlashAttnBlock(), tokens()), SEQ)
    assert found and "flash-attn" in found[0] and "test_sequence_mixing.py" in found[0]


def test_flash_attn_under_cp_stops_at_compile_time_instead_of_attending_locally():
    msg = run_ranks(flash_attn_model_under_cp, 2)[0]
    assert msg is not None and msg.startswith("NotImplementedError") and "flash-attn" in msg


def test_cumsum_along_the_sequence_is_refused_with_its_line():
    (found,) = unlowered_sequence_mixing(dynamo_graph(Cumulative(), tokens()), SEQ)
    assert found.startswith("cumsum along a dimension of the local sequence length (8)")
    assert "cumsum(dim=1)" in found


def test_a_convolution_over_the_sequence_is_refused():
    (found,) = unlowered_sequence_mixing(dynamo_graph(SequenceConv(), tokens()), SEQ)
    assert found.startswith("conv1d over a dimension of the local sequence length (8)")


class Recurrence(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)

    def forward(self, idx):
        from torch._higher_order_ops.scan import scan

        def step(carry, x):
            carry = 0.5 * carry + x
            return carry, carry.clone()
        return scan(step, torch.zeros(2, 32), self.emb(idx), dim=1)[1]


def test_a_scan_over_the_sequence_is_refused():
    (found,) = unlowered_sequence_mixing(dynamo_graph(Recurrence(), tokens()), SEQ)
    assert found.startswith("a scan over the sequence") and "scan(step" in found


def test_an_ordinary_gpt_mixes_nothing_but_its_attention():
    model = TinyGPT(GPTConfig(seq=SEQ))
    assert unlowered_sequence_mixing(dynamo_graph(model, tokens()), SEQ) == []


def test_hugging_face_llama_and_gpt2_mix_nothing_but_their_attention():
    from gradsched.hf import tiny_gpt2, tiny_llama
    for build in (tiny_llama, tiny_gpt2):
        model, _ = build(seq=SEQ)
        graph = dynamo_graph(model, tokens(), torch.arange(SEQ).expand(2, SEQ))
        assert unlowered_sequence_mixing(graph, SEQ) == []
