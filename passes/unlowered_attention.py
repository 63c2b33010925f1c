"""After the CP lowering: every token-mixing op left on one rank's slice of the sequence, named.

Invariant: none; it only reads. It gathers what `context_parallel.lower_attention_to_ring` left
(`ContextParallelReport.left_local`), any attention call of a known form still in the graph at any depth
(`context_parallel.attention_left`), hand-written attention and other sequence mixing
(`sequence_mixing`). The caller refuses a graph for which the list is not empty: left local, each of these
would mix only the rank's own tokens, silently wrong.

Assumes the Dynamo graph after the lowering, and `spec` = (the lowering's report, the local sequence length
or None).
"""
from __future__ import annotations

import torch.fx as fx

from .context_parallel import attention_left
from .sequence_mixing import hand_written_attention, unlowered_sequence_mixing


def unlowered_attention(gm: fx.GraphModule, spec) -> tuple[fx.GraphModule, list[str]]:
    report, seq_len = spec
    left = report.left_local + [a for a in attention_left(gm) if not any(a in w for w in report.left_local)]
    return gm, left + hand_written_attention(gm, seq_len) + unlowered_sequence_mixing(gm, seq_len)
