"""How the tensor-parallel pass splits attention: each rank runs its own heads.

A mixin of passes/tensor_parallel.py's rewriter. q, k and v arrive split by heads ([B, H, S, D],
dim 1) from their column-parallel projections; keys and values whose projection kept fewer heads than
tp can split arrive whole, and each rank takes the heads its queries read (GQA). A mask with one plane
per head is sliced alike. Head counts that tp does not divide are refused at the call's source line.
"""
from __future__ import annotations

import torch.fx as fx

from .tp_layouts import FULL, Shard, TensorParallelError
from .tp_roles import where


class Heads:
    def _attention(self, node) -> None:
        q, k, v = node.args[:3]
        grouped = False  # keys and values narrowed to the groups this rank's queries read (SDPA's enable_gqa)
        if self._l(q) == Shard(1):
            for kv in (k, v):
                if self._l(kv) == FULL:
                    taken = self._heads_for_rank(node, kv)
                    grouped |= taken.target == "narrow"
                    node.replace_input_with(kv, taken)
            q, k, v = node.args[:3]
        lays = [self._l(a) for a in (q, k, v)]
        if any(l != Shard(1) for l in lays):
            raise TensorParallelError(f"the attention at {where(node)} reads q, k, v laid out "
                                      f"{', '.join(map(str, lays))}, not split by heads ([B, H, S, D], dim 1).")
        hq, hk = self.whole[q].shape[1], self.whole[k].shape[1]
        for name, h in (("query", hq), ("key/value", 0 if grouped else hk)):
            if h % self.spec.tp:
                raise TensorParallelError(f"the attention at {where(node)} has {h} {name} heads, which tp="
                                          f"{self.spec.tp} does not divide: choose tp dividing the head counts.")
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if isinstance(mask, fx.Node):  # [.., H or 1, Sq, Sk]: one per head is this rank's heads
            m = self.whole[mask]
            if self._l(mask) != FULL or (m.dim() >= 3 and m.shape[-3] not in (1, hq)):
                raise TensorParallelError(f"the attention at {where(node)} takes an attn_mask of shape "
                                          f"{tuple(m.shape)} laid out {self._l(mask)}, which tensor parallelism "
                                          "cannot split by heads.")
            if m.dim() >= 3 and m.shape[-3] == hq:
                node.replace_input_with(mask, self._slice(mask, m.dim() - 3, 1, node))
        self.lay[node] = Shard(1)

    def _heads_for_rank(self, node, kv: fx.Node) -> fx.Node:
        """Keys or values every rank holds whole: the heads this rank's query heads read."""
        hq, hk = self.whole[node.args[0]].shape[1], self.whole[kv].shape[1]
        tp, rank = self.spec.tp, self.spec.rank
        if hk == hq:
            out = self._slice(kv, 1, 1, node)
        elif (hq // tp) and (hq // hk) % (hq // tp) == 0:  # one key/value head serves several ranks
            with self.graph.inserting_before(node):
                out = self.graph.call_method("narrow", (kv, 1, rank * (hq // tp) // (hq // hk), 1))
            self.whole[out] = self.whole[kv]
        else:
            raise TensorParallelError(f"the attention at {where(node)} has {hq} query and {hk} key/value heads: "
                                      f"tp={tp} cannot give every rank whole groups of them.")
        self.lay[out] = Shard(1)
        return out
