"""How the tensor-parallel pass splits the vocabulary: the embedding's lookup and the loss.

A mixin of passes/tensor_parallel.py's rewriter. The vocab-parallel embedding looks up only the ids in
this rank's rows (the others read row 0 and are zeroed), a partial sum the pass then reduce-scatters
along the sequence. A cross-entropy whose logits arrive split over the vocabulary becomes `spec.cross_entropy`
(gradsched.tp.loss_parallel): the logits are never gathered, and ignore_index, the reduction and label
smoothing over the whole vocabulary are kept.
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.nn.functional as F

from .tp_layouts import FULL, PARTIAL, Layout, Partition, Shard, TensorParallelError, check_divisible
from .tp_roles import where


class Vocab:
    def _input_layout(self, i: int, ph) -> Layout:
        """A graph input that arrives split over the vocabulary (spec.vocab_inputs: a loss graph's logits) is
        this rank's columns along its last dimension; any other input is whole."""
        return Shard(self.whole[ph].dim() - 1) if i in self.spec.vocab_inputs else FULL

    def _keeps_vocab(self, a, lay: Layout, out) -> bool:
        """spec.vocab_output: the graph's one output, split over the vocabulary along its last dimension (the LM
        head's logits), is left as this rank's columns for a loss-parallel loss after the graph."""
        outs = torch.utils._pytree.tree_leaves(out.args)
        if not (self.spec.vocab_output and len(outs) == 1 and lay.segments == 1
                and lay.dim == self.whole[a].dim() - 1):
            return False
        self.record.vocab_output = lay.dim
        return True

    def _embedding(self, node, role) -> None:
        ids, w = node.args[0], node.args[1]
        if self._l(ids).kind != "full":
            raise TensorParallelError(f"the embedding at {where(node)} reads token ids laid out {self._l(ids)}.")
        if role != "vocab":
            node.args = (ids, self._param_arg(node, w)) + tuple(node.args[2:])
            self.lay[node] = FULL
            return
        # F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse), by identity:
        # 0 == False and 2 == 2.0, so a padding_idx of 0 or 2 must not pass for a default
        rest = list(node.args[2:]) + [None] * (7 - len(node.args))
        if rest[0] is not None or rest[1] is not None or rest[2] not in (2, 2.0) or rest[3] not in (False, None) \
                or rest[4] not in (False, None) or node.kwargs:
            raise TensorParallelError(f"the vocab-parallel embedding at {where(node)} has padding_idx, max_norm "
                                      "or sparse set: train it with tp=1, or without them.")
        self._assign(w, Partition("vocab", 0), node)
        vocab = self.whole[w].shape[0]
        lo, n = self.spec.rank * vocab // self.spec.tp, vocab // self.spec.tp
        with self.graph.inserting_before(node):
            g = self.graph
            inside = g.call_function(operator.and_, (g.call_function(operator.ge, (ids, lo)),
                                                     g.call_function(operator.lt, (ids, lo + n))))
            local = g.call_function(operator.mul, (g.call_function(operator.sub, (ids, lo)), inside))
        node.args = (local, w)
        with self.graph.inserting_before(node.next):
            keep = self.graph.call_method("unsqueeze", (inside, -1))
            masked = self.graph.call_function(operator.mul, (node, keep))
        node.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked)
        self.whole[masked] = self.whole[node]
        self.lay[node] = self.lay[masked] = PARTIAL

    def _cross_entropy(self, node) -> None:
        """Loss parallel: the loss from this rank's vocabulary columns, the logits never gathered."""
        a = inspect.signature(F.cross_entropy).bind(*node.args, **node.kwargs).arguments
        logits, target = a["input"], a["target"]
        lay, nd = self._l(logits), self.whole[logits].dim()
        if lay != Shard(1 if nd > 1 else 0) or self._l(target) != FULL:
            raise TensorParallelError(f"the cross-entropy at {where(node)} reads logits laid out {lay} and "
                                      f"targets laid out {self._l(target)}: loss parallel needs [N, vocab] logits "
                                      "split over the vocabulary and whole targets.")
        if nd != 2 or a.get("weight") is not None or a.get("size_average") is not None or a.get("reduce") is not None:
            raise TensorParallelError(f"the cross-entropy at {where(node)} has class weights, legacy reduction "
                                      "arguments or logits of more than two dimensions: flatten the logits to "
                                      "[tokens, vocab] and leave those out.")
        vocab = self.whole[logits].shape[1]
        check_divisible(vocab, lay, self.spec.tp, f"the vocabulary of the cross-entropy at {where(node)}")
        node.target = self.spec.cross_entropy
        node.args = (logits, target, self.spec.rank * vocab // self.spec.tp, vocab, self.spec.group,
                     a.get("ignore_index", -100), a.get("reduction", "mean"), a.get("label_smoothing", 0.0))
        node.kwargs = {}
        self.record.collectives.append(("all_reduce", node.name))
        self.lay[node] = FULL
