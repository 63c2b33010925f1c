"""Hugging Face causal LMs as gradsched clients: unmodified models behind a call adapter.

`CausalLM(model)` gives any `*ForCausalLM` the call gradsched trains with,
(tokens, positions, attention_mask) -> logits: context parallelism hands each rank
non-contiguous positions, so they must come in explicitly (learned position tables and
RoPE read them). The model itself is untouched: its parameters, its tied embedding and
head (one Parameter), its attention layers.

Its attention is HF's, with the masks HF would build handed over as arguments of
gradsched.masks.attention (which the context-parallel lowering turns into the ring or
Ulysses, and which is SDPA in one process):
- each layer's sliding window (Mistral, Qwen2 with use_sliding_window, Gemma2/3's local
  layers), from the `sliding_window` HF passes to the attention function;
- packed documents: position ids that do not step by 1 start a new document, as HF
  detects them when no attention_mask is given (`documents=False` skips this, and the
  per-token mask it costs, for data that is never packed);
- padding: an attention_mask [B, S] hides the pads as keys, as HF's does;
- explicit documents: seq_idx [B, S] (HF's name for it), which the document-balanced layout
  needs (gradsched.cp.layout, load_balance="documents"): documents are then the equal
  seq_idx, and positions only place tokens and measure the window.
Anything else a layer computes (logit soft-capping, attention sinks, dropout, bidirectional or
chunked attention, a mask bent by the model's own mask function) is refused
with UnsupportedAttention naming the model, the layer and the feature, at construction
and again if HF hands such an argument to the attention function: it never computes a
different attention silently.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


class UnsupportedAttention(NotImplementedError):
    """The model's attention does something this adapter does not compute."""


_WHAT_TO_DO = ("gradsched.hf.CausalLM computes causal attention with sliding windows, packed documents and "
               "padding. Train this model without the adapter, or turn the feature off in its config.")


def _layer_features(module) -> list[str]:
    """What this attention layer computes that the adapter does not."""
    out = []
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is not None:
        out.append(f"attention logit soft-capping at {softcap}")
    if getattr(module, "sinks", None) is not None:
        out.append("attention sinks")
    dropout = _attention_dropout(module)
    if dropout:
        out.append(f"attention dropout {dropout} (the config's attention_dropout, attn_pdrop in GPT-2: set it to 0.0)")
    if getattr(module, "is_causal", True) is False:
        out.append("bidirectional attention (is_causal=False)")
    layer_types = getattr(module.config, "layer_types", None)
    if layer_types and module.layer_idx < len(layer_types) and \
            layer_types[module.layer_idx] not in ("full_attention", "sliding_attention"):
        out.append(f"'{layer_types[module.layer_idx]}' attention (config.layer_types)")
    return out


def _attention_dropout(module) -> float:
    """The dropout on attention weights this layer trains with: its `attention_dropout` (a float in Llama and
    most HF models, copied from the config), else its config's, else GPT-2's `attn_dropout` module. HF hands
    it to the attention function only in training mode; checked here, it is refused before any step."""
    p = getattr(module, "attention_dropout", None)
    if p is None:
        p = getattr(module.config, "attention_dropout", None)
    if p is None:
        p = getattr(module, "attn_dropout", None)
    return float(p.p if isinstance(p, nn.Dropout) else p or 0.0)


def _mask_arguments(*args, attention_mask=None, **kwargs):
    """HF's mask hook: the 2-D padding mask through (the masks it would build become arguments of
    gradsched.masks.attention). What it was asked to build beyond those is refused, not dropped:
    a bidirectional mask (asked with allow_is_bidirectional_skip) or one bent by a model's own
    or_mask_function / and_mask_function (asked with use_vmap=True: e.g. image tokens that see each
    other both ways)."""
    config = kwargs.get("config")
    model = getattr(config, "model_type", "the model")
    if "allow_is_bidirectional_skip" in kwargs:
        raise UnsupportedAttention(f"{model} asks for a bidirectional attention mask. {_WHAT_TO_DO}")
    if kwargs.get("use_vmap"):
        raise UnsupportedAttention(f"{model} bends its attention mask with its own mask function (HF's "
                                   f"or_mask_function / and_mask_function). {_WHAT_TO_DO}")
    return attention_mask


def check_supported_attention(model: nn.Module) -> None:
    """Refuse a model any of whose attention layers computes what the adapter does not."""
    for name, module in model.named_modules():
        if not hasattr(module, "layer_idx") or not hasattr(module, "config") or \
                not any(hasattr(module, a) for a in ("q_proj", "c_attn", "qkv_proj")):
            continue
        features = _layer_features(module)
        if features:
            raise UnsupportedAttention(
                f"{type(model).__name__}: attention layer '{name}' (layer {module.layer_idx}, "
                f"{type(module).__name__}) has {' and '.join(features)}. {_WHAT_TO_DO}")


ATTENTION = "gradsched_attention"
ATTENTION_NO_DOCUMENTS = "gradsched_attention_no_documents"


def _register_attention() -> None:
    """HF attention implementations calling gradsched.masks.attention with the model's masks as
    arguments. The mask function hands the 2-D padding mask through (None without padding)
    instead of building a [B, 1, S, S] tensor, which would have to be cut for context
    parallelism and would hide the window and documents from the ring."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from gradsched.cp.attention_masks import attention

    def make(documents: bool):
        def gradsched_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                sliding_window=None, position_ids=None, seq_idx=None, **kwargs):
            changed = [f"{k}={kwargs[k]!r}" for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
            if dropout:
                changed.append(f"dropout={dropout}")
            if changed:
                raise UnsupportedAttention(
                    f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) calls attention with "
                    f"{', '.join(changed)}. {_WHAT_TO_DO}")
            if attention_mask is not None and attention_mask.dim() != 2:
                raise UnsupportedAttention(
                    f"{type(module).__name__}: got a prepared {attention_mask.dim()}-D attention mask. Pass "
                    "the [batch, sequence] padding mask (1: token, 0: pad) as attention_mask.")
            # HF finds packed documents in the position ids only when no padding mask is given
            docs = position_ids if documents and attention_mask is None else None
            if seq_idx is not None:  # explicit documents, with or without padding
                docs = position_ids
            out = attention(query, key, value, causal=True, scale=scaling, window=sliding_window,
                            position_ids=docs, key_padding=attention_mask, seq_idx=seq_idx)
            return out.transpose(1, 2).contiguous(), None
        return gradsched_attention

    AttentionInterface.register(ATTENTION, make(True))
    AttentionInterface.register(ATTENTION_NO_DOCUMENTS, make(False))
    for name in (ATTENTION, ATTENTION_NO_DOCUMENTS):
        AttentionMaskInterface.register(name, _mask_arguments)


class CausalLM(nn.Module):
    """(tokens, positions, attention_mask, seq_idx) -> logits of an unmodified HF causal LM.

    documents: find packed documents in the position ids, as HF does (a per-token mask on
    every attention call). False for data that is never packed: then positions are read
    as positions only, and attention is plain causal (with its window). seq_idx [B, S]
    (optional, HF's kwarg): each token's document, given explicitly; the model's layers
    hand it to the attention function.
    """

    def __init__(self, model: nn.Module, documents: bool = True):
        super().__init__()
        check_supported_attention(model)
        _register_attention()
        model.set_attn_implementation(ATTENTION if documents else ATTENTION_NO_DOCUMENTS)
        self.model = model

    def forward(self, tokens, positions=None, attention_mask=None, seq_idx=None):
        # Computed values, not the model's inputs, reach the attention layers: a pipeline split gives only
        # the first stage the inputs and sends later stages what was computed before them. Tokens are
        # touched first: the split orders the first stage's inputs by first use, and the pipeline
        # schedule hands them over in call order (positions first would swap them, silently).
        tokens = tokens.clone()
        if positions is not None:
            positions = positions.clone()
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        extra = {}
        if seq_idx is not None:
            extra["seq_idx"] = seq_idx.clone()
        return self.model(input_ids=tokens, position_ids=positions, attention_mask=attention_mask,
                          use_cache=False, **extra).logits


def tiny_gpt2(vocab=64, seq=16, dim=32, layers=2, heads=4) -> tuple[nn.Module, list[str]]:
    """A tiny random GPT-2 (tied embeddings, learned positions, SDPA) and its pipeline split point."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers, n_head=heads,
                   attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    c._attn_implementation = "sdpa"
    m = GPT2LMHeadModel(c)
    m.loss_type = "ForCausalLM"  # else a warning_once log call breaks fullgraph
    return CausalLM(m, documents=False), [f"model.transformer.h.{layers // 2}"]


def tiny_llama(vocab=64, seq=16, dim=32, layers=2, heads=4, kv_heads=2) -> tuple[nn.Module, list[str]]:
    """A tiny random Llama (RoPE, GQA, tie_word_embeddings=True, SDPA) and its split point."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                    tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    c._attn_implementation = "sdpa"
    return CausalLM(LlamaForCausalLM(c), documents=False), [f"model.model.layers.{layers // 2}"]


def _tiny(config_cls, model_cls, *, documents=True, vocab, seq, dim, layers, heads, kv_heads=2, **extra):
    c = config_cls(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                   tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None, **extra)
    c._attn_implementation = "sdpa"
    return CausalLM(model_cls(c), documents=documents), [f"model.model.layers.{layers // 2}"]


def tiny_mistral(vocab=64, seq=64, dim=32, layers=2, heads=4, window=16):
    """A tiny random Mistral (sliding window on every layer, GQA, tied embeddings)."""
    from transformers import MistralConfig, MistralForCausalLM
    return _tiny(MistralConfig, MistralForCausalLM, vocab=vocab, seq=seq, dim=dim, layers=layers, heads=heads,
                 sliding_window=window)


def tiny_qwen2(vocab=64, seq=64, dim=32, layers=2, heads=4, window=16):
    """A tiny random Qwen2 with use_sliding_window (every layer windowed: max_window_layers=0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _tiny(Qwen2Config, Qwen2ForCausalLM, vocab=vocab, seq=seq, dim=dim, layers=layers, heads=heads,
                 use_sliding_window=True, sliding_window=window, max_window_layers=0)


def tiny_gemma3(vocab=64, seq=64, dim=32, layers=2, heads=4, window=16):
    """A tiny random Gemma3 text model: a local (windowed) layer then a global one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return _tiny(Gemma3TextConfig, Gemma3ForCausalLM, vocab=vocab, seq=seq, dim=dim, layers=layers, heads=heads,
                 head_dim=dim // heads, sliding_window=window,
                 layer_types=["sliding_attention", "full_attention"] * (layers // 2))


def tiny_gemma(vocab=64, seq=64, dim=32, layers=2, heads=4):
    """A tiny random Gemma (v1: embeddings scaled by sqrt(dim), norms as 1 + weight, one KV head)."""
    from transformers import GemmaConfig, GemmaForCausalLM
    return _tiny(GemmaConfig, GemmaForCausalLM, vocab=vocab, seq=seq, dim=dim, layers=layers, heads=heads,
                 kv_heads=1, head_dim=dim // heads)


def tiny_llama_documents(vocab=64, seq=64, dim=32, layers=2, heads=4):
    """tiny_llama reading packed documents from its position ids (CausalLM(documents=True))."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return _tiny(LlamaConfig, LlamaForCausalLM, vocab=vocab, seq=seq, dim=dim, layers=layers, heads=heads)


MODELS = {"hf_gpt2": tiny_gpt2, "hf_llama": tiny_llama, "hf_mistral": tiny_mistral, "hf_qwen2": tiny_qwen2,
          "hf_gemma3": tiny_gemma3, "hf_gemma": tiny_gemma, "hf_llama_documents": tiny_llama_documents}


HF_EXTRA = "pip install 'gradsched[hf]'"  # transformers is not among gradsched's own dependencies


def require_transformers(what: str) -> None:
    """Refuse in one line, saying what to install, when transformers is missing (an installed gradsched
    depends on torch and networkx only)."""
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise
        raise ModuleNotFoundError(f"{what} needs Hugging Face transformers (5.23 or 5.24), which is not installed: "
                                  f"{HF_EXTRA}", name="transformers") from None


def meta_causal_lm(config, dtype: torch.dtype, checkpointing: bool = False, layers: int | None = None
                   ) -> tuple[CausalLM, int]:
    """(a causal LM of this transformers config on the meta device: shapes, no values, behind CausalLM; its
    number of layers), for the dry run. Any *ForCausalLM that transformers builds from the config with SDPA.
    `layers`: cut to that many decoder layers (the dry run's --fit measures a few)."""
    require_transformers("a Hugging Face model")
    from transformers import AutoModelForCausalLM
    config._attn_implementation = "sdpa"
    if layers is not None:
        config = copy.deepcopy(config)
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
        config.num_hidden_layers = layers
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config).to(dtype)
    if checkpointing:
        # transformers 5.24 renamed it (the old name warns); 5.23 has only the old one
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return CausalLM(m, documents=False), config.num_hidden_layers


# the dry run's built-in shapes, Llama 3.1's (no weights): vocab, hidden, intermediate, layers, heads, kv heads
LLAMA = {
    "llama-8b": (128256, 4096, 14336, 32, 32, 8),
    "llama-70b": (128256, 8192, 28672, 80, 64, 8),
    "llama-tiny": (256, 64, 128, 4, 4, 2),  # for tests: seconds, not minutes
}


def llama(name: str, dtype: torch.dtype, tie: bool = False, checkpointing: bool = False, layers: int | None = None):
    """(model on the meta device, its number of layers) of a built-in Llama config."""
    require_transformers(f"the built-in model {name}")
    from transformers import LlamaConfig
    vocab, hidden, inter, n_layers, heads, kv = LLAMA[name]
    c = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=n_layers,
                    num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=131072,
                    tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return meta_causal_lm(c, dtype, checkpointing, layers)


def from_config(path: str, dtype: torch.dtype, tie: bool = False, checkpointing: bool = False,
                layers: int | None = None):
    """(model on meta, its number of layers) from a Hugging Face config.json, or a directory holding one."""
    require_transformers(f"the config {path}")
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(path)
    if tie:
        c.tie_word_embeddings = True
    return meta_causal_lm(c, dtype, checkpointing, layers)
