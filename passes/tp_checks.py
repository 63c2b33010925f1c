"""What a TP rank's part of the graph cannot compute as one process does, refused by source line.

A mixin of passes/tensor_parallel.py's rewriter: it reads the layouts (`self.lay`, `self._l`) the walk
has assigned and the sequence all-gathers it inserted (`self.gathered`); it changes nothing.
"""
from __future__ import annotations

import torch.nn.functional as F

from .tp_layouts import FULL, TensorParallelError
from .tp_roles import is_op, is_sdpa, where


class Checks:
    def _refuse_dropout(self, node) -> None:
        """Dropout draws the same random numbers on every TP rank (no per-rank generator yet): on a rank's
        tokens or heads that is not one process's dropout."""
        p = None
        if is_op(node, (F.dropout,)):
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            if not node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True):
                p = 0
        elif is_sdpa(node):
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        if p and any(self._l(a).split for a in node.all_input_nodes):
            raise TensorParallelError(f"the dropout at {where(node)} (p={p}) would draw the same random numbers on "
                                      "every TP rank's tokens or heads: train with dropout 0 under tp > 1.")


    def _check_gathers_feed_split_work(self) -> None:
        """A sequence all-gather's backward sums every rank's gradient of the gathered value: right when each
        rank does its own part of the work with it (its columns, its heads), wrong when every rank computes
        the same result from it, which then reaches an output or the loss whole on every rank."""
        for g in self.gathered.values():
            todo, seen = [g], set()
            while todo:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                for u in n.users:
                    if (u.op == "output" and self.outer is None) or (self._l(u) == FULL and
                                                                     is_op(u, (F.cross_entropy,))):
                        raise TensorParallelError(
                            f"{u.name if u.op != 'output' else 'a graph output'} is computed whole on every rank from "
                            f"the tokens all-gathered at {where(n)}: its gradient would be summed tp times. Give the "
                            "head a linear the pass can split over the vocabulary, or train with tp=1.")
                    if self._l(u) == FULL and u.op != "output":
                        todo.append(u)
