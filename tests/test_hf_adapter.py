"""gradsched.hf.CausalLM computes exactly the model's own attention (HF's SDPA path with the masks HF
builds itself: sliding windows, packed documents, padding), or refuses (one process, tiny configs)."""
import copy
import math

import pytest
import torch
import transformers

from gradsched.hf import ATTENTION, CausalLM, UnsupportedAttention, tiny_gpt2, tiny_llama
from tied_training import abs_diff

SEQ = 24
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=None)


def packed_positions():
    """Two rows of packed documents (7 + 12 + 5 and 1 + 23 tokens), positions restarting at 0."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ((7, 12, 5), (1, 23))])


def left_and_right_padding():
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, -6:] = 0
    return mask


def logits_error(model, positions=None, attention_mask=None, documents=True):
    """Max |adapter - HF's own sdpa| over the logits of every token, same weights and inputs (inf if either
    holds a NaN or an inf)."""
    torch.manual_seed(0)
    own = copy.deepcopy(model).eval()
    own.set_attn_implementation("sdpa")
    adapted = CausalLM(model, documents=documents).eval()
    tokens = torch.randint(0, 64, (2, SEQ))
    pos = torch.arange(SEQ).expand(2, SEQ) if positions is None else positions
    with torch.no_grad():
        want = own(input_ids=tokens, position_ids=pos, attention_mask=attention_mask, use_cache=False).logits
        got = adapted(tokens, pos, attention_mask)
    return abs_diff(got, want)  # inf for a NaN or an inf


def mistral(window=5):
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=window))


def qwen2(window=5):
    config = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=window, max_window_layers=0)
    return transformers.Qwen2ForCausalLM(config)


def gemma3(window=5):
    config = transformers.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=window,
                                           layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(config)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


@pytest.mark.parametrize("build", [mistral, qwen2, gemma3], ids=["mistral", "qwen2", "gemma3"])
def test_sliding_windows_compute_the_models_own_attention(build):
    assert logits_error(build()) < 1e-5


@pytest.mark.parametrize("build", [llama, mistral, gemma3], ids=["llama", "mistral", "gemma3"])
def test_packed_documents_compute_the_models_own_attention(build):
    assert logits_error(build(), positions=packed_positions()) < 1e-5


def test_packed_documents_differ_from_one_document():
    """The comparison above can fail: attending across documents changes the logits."""
    assert 1e-3 < logits_error(llama(), positions=packed_positions(), documents=False) < math.inf  # finite


@pytest.mark.parametrize("build", [llama, mistral], ids=["llama", "mistral"])
def test_padding_masks_compute_the_models_own_attention_on_every_real_token(build):
    torch.manual_seed(0)
    model = build()
    own = copy.deepcopy(model).eval()
    own.set_attn_implementation("sdpa")
    mask = left_and_right_padding()
    tokens = torch.randint(0, 64, (2, SEQ))
    pos = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        want = own(input_ids=tokens, position_ids=pos, attention_mask=mask, use_cache=False).logits
        got = CausalLM(model).eval()(tokens, pos, mask)
    real = mask.bool()  # HF's outputs at left pads (rows that see nothing) are its own convention
    assert (got - want)[real].abs().max() < 1e-5


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_models_without_windows_compute_their_own_attention(build):
    adapted, _ = build(seq=SEQ)
    assert logits_error(adapted.model, documents=False) < 1e-5


def test_logit_soft_capping_is_refused_naming_model_and_layer():
    config = transformers.Gemma2Config(**SMALL, head_dim=8, attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedAttention) as err:
        CausalLM(transformers.Gemma2ForCausalLM(config))
    assert "Gemma2ForCausalLM" in str(err.value) and "soft-capping" in str(err.value)


def test_the_attention_function_itself_refuses_soft_capping_and_dropout():
    CausalLM(tiny_llama()[0].model)  # registers the attention function
    fn = transformers.AttentionInterface()[ATTENTION]
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(UnsupportedAttention, match="softcap=30.0"):
        fn(torch.nn.Module(), q, q, q, None, softcap=30.0)
    with pytest.raises(UnsupportedAttention, match="dropout=0.1"):
        fn(torch.nn.Module(), q, q, q, None, dropout=0.1)


def test_bidirectional_attention_is_refused_naming_model_and_layer():
    config = transformers.Gemma3TextConfig(**SMALL, head_dim=8, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedAttention) as err:
        CausalLM(transformers.Gemma3ForCausalLM(config))
    assert "Gemma3ForCausalLM" in str(err.value) and "bidirectional attention" in str(err.value)


def test_chunked_attention_layers_are_refused_naming_the_layer_type():
    config = transformers.Llama4TextConfig(**SMALL, head_dim=8, intermediate_size_mlp=16, num_local_experts=2,
                                           attention_chunk_size=4)
    with pytest.raises(UnsupportedAttention, match="'chunked_attention' attention"):
        CausalLM(transformers.Llama4ForCausalLM(config))


def test_the_mask_hook_refuses_masks_it_would_otherwise_drop():
    # a model that builds a mask past causal/window/documents/padding must not get the plain causal one
    CausalLM(tiny_llama()[0].model)  # registers the mask hook
    hook = transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[ATTENTION]
    with pytest.raises(UnsupportedAttention, match="bidirectional attention mask"):
        hook(attention_mask=None, allow_is_bidirectional_skip=True)
    with pytest.raises(UnsupportedAttention, match="or_mask_function"):
        hook(attention_mask=None, use_vmap=True)
    pad = torch.ones(2, 8, dtype=torch.long)
    assert hook(attention_mask=pad, allow_is_causal_skip=True, use_vmap=False) is pad
