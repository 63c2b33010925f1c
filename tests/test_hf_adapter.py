"""gradsched.hf.CausalLM computes exactly the model's own attention, or refuses (one process, tiny configs)."""
import copy

import pytest
import torch
import transformers

from gradsched.hf import CAUSAL_SDPA, CausalLM, UnsupportedAttention, tiny_gpt2, tiny_llama

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=None)


def logits_match_the_models_own(model):
    """The adapter's logits against the same weights under HF's own attention (sdpa, causal mask)."""
    torch.manual_seed(0)
    own = copy.deepcopy(model).eval()
    adapted = CausalLM(model).eval()
    tokens = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        want = own(input_ids=tokens, position_ids=pos, use_cache=False).logits
        got = adapted(tokens, pos)
    return (got - want).abs().max().item()


def test_mistral_with_a_sliding_window_is_refused_naming_model_layer_and_window():
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=4))
    with pytest.raises(UnsupportedAttention) as err:
        CausalLM(model)
    msg = str(err.value)
    assert "MistralForCausalLM" in msg and "model.layers.0.self_attn" in msg and "sliding window of 4" in msg


def test_qwen2_with_use_sliding_window_is_refused():
    config = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(UnsupportedAttention, match="Qwen2ForCausalLM.*sliding window of 4"):
        CausalLM(transformers.Qwen2ForCausalLM(config))


def test_qwen2_without_sliding_window_is_accepted_and_computes_the_models_attention():
    config = transformers.Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=4)
    config._attn_implementation = "sdpa"
    assert logits_match_the_models_own(transformers.Qwen2ForCausalLM(config)) < 1e-5


def test_gemma3_with_local_layers_is_refused_naming_a_local_layer():
    config = transformers.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=4,
                                           layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(UnsupportedAttention) as err:
        CausalLM(transformers.Gemma3ForCausalLM(config))
    assert "Gemma3ForCausalLM" in str(err.value) and "layer 0" in str(err.value)


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_models_without_windows_compute_their_own_attention(build):
    adapted, _ = build()
    model = adapted.model
    model.set_attn_implementation("sdpa")  # undo the adapter's choice: compare with HF's own path
    assert logits_match_the_models_own(model) < 1e-5


def test_a_padding_mask_is_refused_instead_of_ignored():
    adapted, _ = tiny_llama()
    tokens = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    with pytest.raises(UnsupportedAttention, match="attention_mask"):
        adapted(tokens, torch.arange(16).expand(2, 16), attention_mask=mask)


def test_the_attention_function_itself_refuses_a_sliding_window():
    CausalLM(tiny_llama()[0].model)  # registers the attention function
    fn = transformers.AttentionInterface()[CAUSAL_SDPA]
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(UnsupportedAttention, match="sliding_window=4"):
        fn(torch.nn.Module(), q, q, q, None, sliding_window=4)
