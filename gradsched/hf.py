"""Hugging Face causal LMs as gradsched clients: unmodified models behind a call adapter.

`CausalLM(model)` gives any `*ForCausalLM` the call gradsched trains with,
(tokens, positions) -> logits: context parallelism hands each rank non-contiguous
positions, so they must come in explicitly (learned position tables and RoPE
read them). The model itself is untouched: its parameters, its tied embedding
and head (one Parameter), its SDPA attention.
"""
from __future__ import annotations

import torch.nn as nn


CAUSAL_SDPA = "gradsched_causal_sdpa"


def _register_causal_sdpa() -> None:
    """An HF attention implementation: SDPA with is_causal=True and no mask tensor.

    For a causal LM without padding, the mask HF would build is exactly the causal
    one; as a tensor it would also have to be sharded for context parallelism and
    would defeat the ring (which computes causal blocks itself). So the mask
    function returns None and SDPA gets is_causal=True, which the ring lowers.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register(CAUSAL_SDPA, causal_sdpa)
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)


class CausalLM(nn.Module):
    """(tokens, positions) -> logits of an unmodified HF causal LM, without padding.

    Selects the causal-SDPA attention implementation above through HF's own
    registry (the model's code and weights are untouched).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        _register_causal_sdpa()
        model.set_attn_implementation(CAUSAL_SDPA)
        self.model = model

    def forward(self, tokens, positions=None):
        return self.model(input_ids=tokens, position_ids=positions, use_cache=False).logits


def tiny_gpt2(vocab=64, seq=16, dim=32, layers=2, heads=4) -> tuple[nn.Module, list[str]]:
    """A tiny random GPT-2 (tied embeddings, learned positions, SDPA) and its pipeline split point."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers, n_head=heads,
                   attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    c._attn_implementation = "sdpa"
    m = GPT2LMHeadModel(c)
    m.loss_type = "ForCausalLM"  # else a warning_once log call breaks fullgraph
    return CausalLM(m), [f"model.transformer.h.{layers // 2}"]


def tiny_llama(vocab=64, seq=16, dim=32, layers=2, heads=4, kv_heads=2) -> tuple[nn.Module, list[str]]:
    """A tiny random Llama (RoPE, GQA, tie_word_embeddings=True, SDPA) and its split point."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                    tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    c._attn_implementation = "sdpa"
    return CausalLM(LlamaForCausalLM(c)), [f"model.model.layers.{layers // 2}"]


MODELS = {"hf_gpt2": tiny_gpt2, "hf_llama": tiny_llama}
