"""Under context parallelism nothing mixes tokens locally by accident: each form is lowered or refused."""
import pytest
import torch
import torch.nn as nn

from gradsched.launch import run_ranks
from gradsched.passes.sequence_mixing import hand_written_attention, unlowered_sequence_mixing
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
    torch._dynamo.reset()  # many models share a forward: without it, Dynamo stops compiling it after 8
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


# ---- hand-written attention: found by dataflow from q @ k^T to the normalisation, however long the chain ----

HEADS, DIM = 2, 16


class HandWritten(nn.Module):
    """q @ k^T, the case's steps between the product and the attention weights (`weights`), then @ v.
    pos: the tokens' positions [B, S] (train_step hands them over under CP)."""

    def __init__(self, weights, checkpointed=False):
        super().__init__()
        self.qkv, self.weights, self.checkpointed = nn.Linear(DIM, 3 * DIM), weights, checkpointed
        self.bias = nn.Parameter(torch.zeros(HEADS, 1, 1))  # a learned per-head bias on the scores

    def attend(self, x, pos):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        return (self.weights(self, q, k, pos) @ v).transpose(1, 2).reshape(b, s, DIM)

    def forward(self, x, pos=None):
        pos = torch.arange(x.shape[1]).expand(x.shape[:2]) if pos is None else pos
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.attend, x, pos, use_reentrant=False)
        return self.attend(x, pos)


def soft_capped(m, q, k, pos):
    return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) / 4.0 / 50.0) * 50.0, dim=-1)


def biased_in_fp32(m, q, k, pos):
    return torch.softmax((q @ k.transpose(-1, -2) * 0.25 + m.bias).float(), dim=-1).to(q.dtype)


def scaled_in_fp32(m, q, k, pos):
    return torch.softmax(q.float() @ k.float().transpose(-1, -2) * 0.25, dim=-1).to(q.dtype)


def mask_added(m, q, k, pos):
    hidden = (pos[:, None, None, :] > pos[:, None, :, None]) * -1e9  # causal, from the positions
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + hidden, dim=-1)


def softmax_written_out(m, q, k, pos):
    s = q @ k.transpose(-1, -2) * 0.25
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def einsum_then_masked_fill(m, q, k, pos):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k).masked_fill(pos[:, None, None, :] > pos[:, None, :, None], -1e9)
    return torch.nn.functional.softmax(s, dim=-1)


STEPS = [lambda s: s / 3.0, torch.tanh, lambda s: s * 30.0, lambda s: s.float(), lambda s: s + 1.0,
         lambda s: s.transpose(-1, -2), lambda s: s.clamp(-1e4, 1e4), lambda s: s.contiguous(),
         lambda s: torch.where(s > -1e4, s, torch.full_like(s, -1e4)), lambda s: s.to(torch.float32)]


def chain_of(depth):
    """softmax after `depth` elementwise and shape steps between it and q @ k^T (cycling through STEPS)."""
    def weights(m, q, k, pos):
        s = q @ k.transpose(-1, -2)
        for i in range(depth):
            s = STEPS[i % len(STEPS)](s)
        return torch.softmax(s, dim=-1)
    return weights


def states():
    return torch.randn(2, SEQ, DIM)


def found_in(model, x=None, dtype=torch.float32):
    return hand_written_attention(dynamo_graph(model.to(dtype), states().to(dtype) if x is None else x))


@pytest.mark.parametrize("weights", [soft_capped, biased_in_fp32, scaled_in_fp32, mask_added, softmax_written_out,
                                     einsum_then_masked_fill])
def test_hand_written_attention_is_found_with_its_line_whatever_lies_between_the_product_and_the_softmax(weights):
    (found,) = found_in(HandWritten(weights), dtype=torch.bfloat16 if "fp32" in weights.__name__ else torch.float32)
    assert "over the scores of" in found and f"test_sequence_mixing.py\", line" in found
    assert f"in {weights.__name__}" in found  # the user's own line: the frame of the function computing it


@pytest.mark.parametrize("depth", [0, 5, 8, 12, 20])
def test_a_chain_of_any_length_between_the_product_and_the_softmax_is_still_attention(depth):
    # mutation: the old finder looked 4 steps back from the softmax, and missed 5 and more
    (found,) = found_in(HandWritten(chain_of(depth)))
    assert found.startswith("softmax ")


def test_attention_inside_an_activation_checkpoint_is_found_in_its_body():
    (found,) = found_in(HandWritten(chain_of(8), checkpointed=True))
    assert "in weights: return torch.softmax(s, dim=-1)" in found


class Classifier(nn.Module):
    """Softmaxes that are no attention: over a classifier's logits (x @ W, F.linear), and after an MLP."""

    def __init__(self):
        super().__init__()
        self.w, self.mlp = nn.Parameter(torch.randn(DIM, 5)), nn.Sequential(nn.Linear(DIM, 32), nn.GELU(),
                                                                             nn.Linear(32, SEQ))

    def forward(self, x, pos=None):
        by_matmul = torch.softmax((x @ self.w).float() * 2.0, dim=-1)
        gate = torch.log_softmax(self.mlp(x), dim=-1)  # [B, S, S]: square, but a parameter's product
        return by_matmul.sum() + gate.logsumexp(dim=-1).sum()


def test_softmax_over_a_classifier_or_an_mlp_is_not_attention():
    assert found_in(Classifier()) == []


def test_models_whose_attention_is_one_call_have_no_hand_written_attention():
    from gradsched.hf import tiny_llama
    assert hand_written_attention(dynamo_graph(TinyGPT(GPTConfig(seq=SEQ)), tokens())) == []
    model, _ = tiny_llama(seq=SEQ)
    assert hand_written_attention(dynamo_graph(model, tokens(), torch.arange(SEQ).expand(2, SEQ)), SEQ) == []


class TalkingHeads(nn.Module):
    """Heads mixed per token: softmax over [B, S, H, H], square but no token pairs."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, DIM // 4).unbind(2)  # 4 heads of 4: no size is the sequence's
        return (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v).reshape(b, s, DIM)


def test_a_square_product_of_other_sizes_than_the_sequence_is_attention_only_without_the_length():
    graph = dynamo_graph(TalkingHeads(), states())
    assert hand_written_attention(graph, seq_len=SEQ) == []
    assert len(hand_written_attention(graph)) == 1  # unknown length: refused rather than risked


def hf_eager(name):
    """A tiny random HF model with its own eager attention (no adapter): q @ k^T, soft-capping (Gemma2),
    the mask added, softmax in fp32."""
    import transformers
    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                     "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}[name]
    extra = {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4} if name == "gemma2" else {}
    c = getattr(transformers, config)(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=None,
                                      attn_implementation="eager", **extra)
    return getattr(transformers, model)(c)


@pytest.mark.parametrize("mask", [False, True], ids=["no_mask", "all_ones_mask"])
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_hugging_face_eager_attention_is_found_in_every_layer(name, mask):
    model = hf_eager(name)
    kwargs = {"attention_mask": torch.ones(2, SEQ, dtype=torch.long)} if mask else {}
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch.compile(model, backend=capture, fullgraph=True)(input_ids=tokens(), use_cache=False, **kwargs)
    found = hand_written_attention(graphs[0], SEQ)
    assert [f"model.layers.{i}.self_attn'" in f for i, f in enumerate(found)] == [True, True]
    assert all(f"modeling_{name}.py\", line" in f and "eager_attention_forward" in f for f in found)


class HFLogits(nn.Module):
    """An HF model called as train_step calls a model under CP: (tokens, positions, attention_mask) -> logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions=None, attention_mask=None):
        return self.model(input_ids=tokens, position_ids=positions, attention_mask=attention_mask,
                          use_cache=False).logits


def silent_cases_under_cp(rank, world):
    """Issue 29's three silent cases, each trained one step at cp=world: the error each ends with."""
    import gradsched
    plan = gradsched.ParallelPlan.from_world(cp=world)
    torch.manual_seed(0)
    cases = {"soft_capped": (HandWritten(soft_capped), states(), None),
             "biased_in_fp32": (HandWritten(biased_in_fp32), states(), None),
             "gemma2_eager_all_ones_mask": (HFLogits(hf_eager("gemma2")), torch.randint(0, 64, (2, 16)),
                                            torch.ones(2, 16, dtype=torch.long))}
    errors = {}
    for name, (model, x, mask) in cases.items():
        def loss_fn(out, y):
            return (out.float() - 1.0).pow(2).mean()
        parallel = gradsched.parallelize(model, plan=plan, compiler="eager", loss_fn=loss_fn)
        try:
            parallel.train_step(x, x, attention_mask=mask)
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


def test_the_three_silent_cases_of_issue_29_are_refused_under_cp_with_the_source_line():
    errors = run_ranks(silent_cases_under_cp, 2, timeout_s=300)[0]
    for name, line in (("soft_capped", "test_sequence_mixing.py\", line"),
                       ("biased_in_fp32", "test_sequence_mixing.py\", line"),
                       ("gemma2_eager_all_ones_mask", "modeling_gemma2.py\", line")):
        msg = errors[name]
        assert msg is not None and msg.startswith("NotImplementedError") and "silently wrong" in msg, (name, msg)
        assert "softmax 'softmax' over the scores of" in msg and line in msg, (name, msg)
