"""Tensor parallelism: what runs where `passes.tensor_parallel` split a model's layers over a TP group.

Owns the collectives the pass inserts, each with its conjugate as its backward (collectives), the
cross-entropy over vocab-parallel logits (loss_parallel), a rank's shard of a parameter (local_shards),
and one TP rank's graph compiled over its shards with its backward proved (local_graph).

May import: torch, gradsched.passes, the foundation modules (gradsched.plan, gradsched.options,
gradsched.user_errors), gradsched.cp and gradsched.sync (the pass pipeline). Never training or the
public API above it.
"""
