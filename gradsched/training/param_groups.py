"""Parameter groups by name: which optimizer options each parameter trains with.

A distributed optimizer steps pieces of flat buckets, not the user's Parameters, so
groups are resolved by the parameter's name in the unsplit model:

    param_groups=gradsched.weight_decay_groups(0.1)         # decay matrices only (the common case)
    param_groups=lambda name, p: {"lr": 1e-4} if name.startswith("wte") else {}
    param_groups=[{"params": ["lm_head.weight"], "lr": 1e-4}]   # torch style, names or Parameters

Options a group does not set come from the optimizer's keyword arguments. Copies of one
weight (a tie across stages, or one Parameter under several names) must get one set of
options, else they would drift apart: a group listing one of its names covers all of them
(as torch's groups list the Parameter once), and a function is asked under each name and
refused if its answers differ.
"""
from __future__ import annotations

from typing import Callable

import torch


def weight_decay_groups(weight_decay: float) -> Callable:
    """Decay on matrices (embeddings, linear weights) only; biases and norm weights (1-D) decay-free."""
    def options(name: str, p: torch.Tensor) -> dict:
        return {"weight_decay": weight_decay if p.dim() >= 2 else 0.0}
    return options


def options_by_name(spec, params: dict[str, torch.nn.Parameter], copies: dict[str, list[str]],
                    unsplit: list[tuple[str, torch.nn.Parameter]]) -> dict[str, dict]:
    """name -> group options for every parameter in `params` (name -> Parameter, this rank's).

    spec: None, a function (name, parameter) -> options, or torch-style groups whose "params"
    list names or Parameters of the unsplit model. copies: name -> every name of the same
    weight (ties, aliases). unsplit: the unsplit model's named_parameters(remove_duplicate=False),
    by which names and Parameters are checked and matched (a stage holds only its own)."""
    if spec is None:
        return {n: {} for n in params}
    lookup = spec if callable(spec) else _from_groups(spec, unsplit)
    out = {}
    for name, p in params.items():
        seen = {n: dict(lookup(n, p) or {}) for n in copies.get(name, [name])}
        if len({repr(sorted(o.items())) for o in seen.values()}) > 1:
            raise ValueError(
                f"param_groups give one weight different options under its names: {seen}. Copies of one "
                "weight (tied across stages or shared within a module) must train alike, or they drift apart: "
                "give every name of it the same options.")
        if "params" in seen[name]:
            raise ValueError(f"param_groups returned a 'params' entry for {name!r}: return options only.")
        out[name] = seen[name]
    return out


def _from_groups(groups, unsplit) -> Callable:
    """A lookup by name from torch-style groups, whose Parameters are matched by identity in the
    unsplit model (under pp > 1 a stage's Parameters are not the user's objects)."""
    names_of: dict[int, list[str]] = {}
    for n, p in unsplit:
        names_of.setdefault(id(p), []).append(n)
    by_param_name = dict(unsplit)
    known = set(by_param_name)
    by_name: dict[str, dict] = {}
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"param group {i} is not a dict with a 'params' list.")
        opts = {k: v for k, v in g.items() if k != "params"}
        for x in g["params"]:
            if isinstance(x, str):
                if x not in known:
                    raise ValueError(f"param group {i} names {x!r}, which is not a parameter of the model "
                                     f"(it has {sorted(known)[:6]}...).")
                names = names_of[id(by_param_name[x])]  # one weight: every name it has, as torch would
            elif isinstance(x, torch.Tensor):
                names = names_of.get(id(x))
                if names is None:
                    raise ValueError(f"param group {i} lists a tensor of shape {tuple(x.shape)} that is not a "
                                     "parameter of the model given to the optimizer.")
            else:
                raise TypeError(f"param group {i} lists {type(x).__name__}: give parameter names or Parameters.")
            for n in names:
                if n in by_name and by_name[n] != opts:
                    raise ValueError(f"{n!r} is in two param groups with different options.")
                by_name[n] = opts
    return lambda name, p: by_name.get(name, {})
