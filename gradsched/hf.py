"""Hugging Face causal LMs as gradsched clients: unmodified models behind a call adapter.

`CausalLM(model)` gives any `*ForCausalLM` the call gradsched trains with,
(tokens, positions) -> logits: context parallelism hands each rank non-contiguous
positions, so they must come in explicitly (learned position tables and RoPE
read them). The model itself is untouched: its parameters, its tied embedding
and head (one Parameter), its SDPA attention.

The adapter computes plain causal attention. A model whose attention is anything
else (a sliding window on any layer: Mistral, Qwen2 with use_sliding_window,
Gemma2/3's local layers; logit soft-capping; attention sinks) or a call with a
padding mask is refused with UnsupportedAttention naming the model, the layer and
the feature, at construction and again if HF hands such an argument to the
attention function: it never computes a different attention silently.
"""
from __future__ import annotations

import torch.nn as nn


class UnsupportedAttention(NotImplementedError):
    """The model's attention is not plain causal attention, which is all this adapter computes."""


_WHAT_TO_DO = ("gradsched.hf.CausalLM computes plain causal attention only (sliding windows, padding and "
               "packed documents in the context-parallel ring are the issue 'Context parallelism for real "
               "models'). Train this model without the adapter, or, if no sequence is ever longer than the "
               "window, set the config's sliding_window to None.")


def _layer_features(module) -> list[str]:
    """What this attention layer computes beyond plain causal attention."""
    if hasattr(module, "sliding_window"):
        window = module.sliding_window  # Qwen2, Gemma: per layer, None on full-attention layers
    else:
        window = getattr(module.config, "sliding_window", None)  # Mistral reads it from the config per call
    out = []
    if window is not None:
        out.append(f"a sliding window of {window} tokens")
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is not None:
        out.append(f"attention logit soft-capping at {softcap}")
    if getattr(module, "sinks", None) is not None:
        out.append("attention sinks")
    return out


def check_plain_causal_attention(model: nn.Module) -> None:
    """Refuse a model any of whose attention layers is not plain causal attention."""
    for name, module in model.named_modules():
        if not hasattr(module, "layer_idx") or not hasattr(module, "config") or \
                not any(hasattr(module, a) for a in ("q_proj", "c_attn", "qkv_proj")):
            continue
        features = _layer_features(module)
        if features:
            raise UnsupportedAttention(
                f"{type(model).__name__}: attention layer '{name}' (layer {module.layer_idx}, "
                f"{type(module).__name__}) has {' and '.join(features)}. {_WHAT_TO_DO}")


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
        # a backstop for what the construction-time check could not see in the module
        changed = [f"{k}={kwargs[k]!r}" for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
        if changed:
            raise UnsupportedAttention(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) calls attention with "
                f"{', '.join(changed)}. {_WHAT_TO_DO}")
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
        check_plain_causal_attention(model)
        _register_causal_sdpa()
        model.set_attn_implementation(CAUSAL_SDPA)
        self.model = model

    def forward(self, tokens, positions=None, attention_mask=None):
        if attention_mask is not None:
            raise UnsupportedAttention(
                f"{type(self.model).__name__}: an attention_mask (padding) was passed. {_WHAT_TO_DO} Pad on the "
                "right and give the pads' labels ignore_index instead: causal attention never lets a real "
                "token see a pad after it, and the loss skips them.")
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
