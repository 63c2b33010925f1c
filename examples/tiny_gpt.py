"""A tiny GPT with its LM head tied to the word embedding (as nanoGPT and GPT-2 tie them).

Used by the demo, the tests and the benchmarks: small enough for CPU processes,
with everything that matters here (a tied weight used at both ends, SDPA).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2
    checkpoint: str = ""  # activation checkpointing of every block in training: see checkpoint_kwargs


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        # no qkv bias: the key bias has an exactly-zero gradient (softmax ignores a per-query
        # constant), and Adam would turn its rounding noise into lr-sized steps, so no two
        # correct implementations could agree on it
        self.qkv, self.proj = nn.Linear(c.dim, 3 * c.dim, bias=False), nn.Linear(c.dim, c.dim)
        self.fc, self.out = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.wte, self.wpe = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two uses
        self.apply(self._init)

    @staticmethod
    def _init(m):  # GPT-2's init: small weights, so the first logits are near uniform
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, pos=None):
        # pos: token positions; context parallelism passes each rank's own (non-contiguous) ones
        pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.config.checkpoint and self.training:
                x = checkpoint(block, x, **checkpoint_kwargs(self.config.checkpoint))
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) \
        else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(mode: str) -> dict:
    """torch.utils.checkpoint's arguments for an activation-checkpointing mode: "reentrant",
    "non_reentrant", or "selective" (non-reentrant with a context_fn policy: matmul outputs
    saved, everything else, attention included, recomputed in the backward)."""
    if mode == "selective":
        return {"use_reentrant": False,
                "context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls)}
    if mode not in ("reentrant", "non_reentrant"):
        raise ValueError(f"unknown checkpoint mode {mode!r}: 'reentrant', 'non_reentrant' or 'selective'")
    return {"use_reentrant": mode == "reentrant"}


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # fp32 loss, as usual in bf16


def lm_loss_sum(logits, targets):
    """Summed over tokens: what average=False (gradients summed, not averaged) trains."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def make_batch(n: int, c: GPTConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, c.vocab, (n, c.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
