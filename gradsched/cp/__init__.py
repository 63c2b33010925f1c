"""Context parallelism: exact attention over a sequence sharded across a CP group.

Owns what runs when `passes.context_parallel` has replaced an attention call: the ring
(ring_attention, ring_schedule, ring_blocks, ring_masked), Ulysses and hybrid (ulysses, hybrid,
groups), the block kernels (attention_kernels, triton_attention), the masks (masks), where each
rank's tokens come from (layout, balance), and which scheme runs a call and what it refuses
(comm). ring_simulation runs the same ring every rank in turn in one process.

May import: torch, gradsched.passes and the foundation modules (gradsched.plan, gradsched.options,
gradsched.user_errors). Never the sync runtime, training or the public API above it.
"""
