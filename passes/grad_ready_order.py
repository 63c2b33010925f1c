"""Read the order in which parameter gradients become ready in a backward graph.

Invariant: none; this pass only reads. It returns the parameters in the order
of the nodes that produce their gradients, which is the order a bucketed
reducer should fill buckets so the first bucket can be reduced while the rest
of the backward is still computing.

Assumes the graph is an AOT backward graph (or any graph whose outputs are
gradients) and that `grad_names` maps output positions to parameter names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class GradSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    output_index: int  # position among the graph's outputs

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def grad_ready_order(gm: fx.GraphModule, grad_names: dict[int, str]) -> list[GradSpec]:
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    outputs = gm.graph.output_node().args[0]
    ready = []
    for idx, name in grad_names.items():
        node = outputs[idx]
        if not isinstance(node, fx.Node):
            continue  # no gradient flows to this parameter in this graph
        val = node.meta["val"]
        ready.append((position[node], idx, GradSpec(name, tuple(val.shape), val.dtype, idx)))
    return [spec for _, _, spec in sorted(ready, key=lambda t: (t[0], t[1]))]
