"""What context parallelism and the HF adapter refuse or report, each in one process (issue 29): attention
dropout at CausalLM's construction, hybrid at a cp with no inner all-to-all degree, and every mask a lowered
call applies named by the schedule report."""
import pytest
import torch
import transformers

from gradsched.hf import CausalLM, UnsupportedAttention
from gradsched.masks import attention
from gradsched.passes.context_parallel import RingSpec, lower_attention_to_ring
from gradsched.sync.schedule_report import attention_report
from gradsched.cp.ring_attention import RingAttentionError, check_attention_call, ring_attention

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=None)


@pytest.mark.parametrize("build", [
    lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attention_dropout=0.1)),
    lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                 attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)),
], ids=["llama_attention_dropout", "gpt2_attn_pdrop"])
def test_attention_dropout_is_refused_at_construction_naming_the_model_class(build):
    model = build()
    with pytest.raises(UnsupportedAttention, match=rf"^{type(model).__name__}: .*attention dropout 0.1"):
        CausalLM(model)


def test_a_model_without_attention_dropout_is_accepted():
    CausalLM(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attention_dropout=0.0)))


@pytest.mark.parametrize("cp", [2, 3])
def test_hybrid_at_a_cp_without_an_inner_degree_names_cp_not_the_heads(cp):
    with pytest.raises(RingAttentionError) as err:  # 12 heads would split over any degree: cp is the cause
        check_attention_call("c", q_heads=12, kv_heads=12, local_len=8, cp=cp, causal=True, comm="hybrid")
    msg = str(err.value)
    assert f"cp={cp} has none" in msg and "strictly between 1 and cp" in msg and "heads split over them" in msg
    assert "comm='ring'" in msg and "comm='a2a'" in msg and "query" not in msg


def packed_and_padded(q, k, v, positions, padding):
    return attention(q, k, v, position_ids=positions, key_padding=padding)


def explicit_documents(q, k, v, positions, seq_idx):
    return attention(q, k, v, position_ids=positions, seq_idx=seq_idx.long())  # documents 1 1 1 1 1 1 0 0


def windowed_documents(q, k, v, positions, padding):
    return attention(q, k, v, window=4, position_ids=positions)


def report_of(fn, load_balance):
    """The schedule report's lines for fn's lowered call at cp=2 (one process: nothing is run)."""
    q = torch.randn(1, 4, 8, 8)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(q, q, q, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
                                                      torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]).bool())
    spec = RingSpec("cp", 2, attention=ring_attention, check=check_attention_call, load_balance=load_balance)
    return attention_report([lower_attention_to_ring(graphs[0], spec)[1]])


@pytest.mark.parametrize("fn, load_balance, masks", [
    (packed_and_padded, True, "causal, documents (where position ids restart), padding (attention_mask)"),
    (windowed_documents, True, "causal, window 4, documents (where position ids restart)"),
    (explicit_documents, "documents", "causal, documents (seq_idx)"),
], ids=["packed_padded_head_tail", "window_packed_head_tail", "seq_idx_documents_balanced"])
def test_the_schedule_report_names_every_mask_a_lowered_call_applies(fn, load_balance, masks):
    assert f"\n       masks: {masks}" in report_of(fn, load_balance)
