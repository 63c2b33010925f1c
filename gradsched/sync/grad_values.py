"""W's gradients as autograd would hold them in .grad: added in, owned, or zeros."""
from __future__ import annotations

import torch


def accumulate(grads: dict, names: dict, params: dict) -> None:
    """Add W's gradients (output position -> tensor) into their parameters' .grad, as autograd would."""
    for i, g in grads.items():
        if g is None or i not in names:
            continue
        p = params[names[i]]
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g


def own(outputs, inputs) -> list:
    """W's outputs as tensors .grad may own (autograd's AccumulateGrad copies a gradient others hold): a copy of
    one that is (a view of) an input, or that an earlier output already is (two parameters' gradients one node)."""
    owned, seen = [], set()
    for g in outputs:
        if g is not None and (g._is_view() or id(g) in seen or any(g is a for a in inputs)):
            g = g.clone()
        if g is not None:
            seen.add(id(g))
        owned.append(g)
    return owned


def grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
