"""Tie discovery: which parameters are one weight, within a module and across stages.

Within a module a tie is shared identity: `named_parameters(remove_duplicate=False)`
lists one Parameter under several names. Dynamo lifts it as ONE graph input and
the backward graph already sums both uses, so nothing needs scheduling.

Across pipeline stages the copies are separate tensors (separate processes):
their gradients must be summed over the tie group. We read them from
`torch.distributed.pipelining`'s `pipe.replicated_params` (the split records each
shared Parameter it copied into several stages). A hand-written list is accepted
only as an override.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Tie:
    """One weight held by several stages: stage -> that stage's local parameter name."""
    members: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.members)

    @property
    def key(self) -> str:
        return "~".join(f"{s}:{n}" for s, n in self.members)

    def name_on(self, stage: int) -> str | None:
        return dict(self.members).get(stage)


def shared_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of names under which one Parameter object appears (len >= 2 each)."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    return [names for names in by_id.values() if len(names) > 1]


def ties_from_pipe(pipe) -> list[Tie]:
    """Cross-stage ties recorded by torch.distributed.pipelining's pipeline()."""
    ties = []
    for entry in getattr(pipe, "replicated_params", []) or []:
        members = tuple(sorted((int(sub.rsplit("_", 1)[1]), name) for sub, name in entry.items()))
        if len(members) > 1:
            ties.append(Tie(members))
    return sorted(ties, key=lambda t: t.key)


def ties_from_override(spec: list[dict[int, str]]) -> list[Tie]:
    """An explicit declaration: [{stage: local_name, ...}, ...]."""
    return sorted((Tie(tuple(sorted(d.items()))) for d in spec if len(d) > 1), key=lambda t: t.key)


class TieMismatch(ValueError):
    """Tied copies that gradsched cannot keep equal, or a tie declaration that does not fit the model."""


def used_parameters(stage_module: nn.Module, prefix: str = "") -> set[str]:
    """Parameter names a split stage's graph reads: its get_attr targets, and, through the submodules
    it calls, theirs (a called submodule without a graph, such as nn.Linear, reads all of its own).
    Pipelining's split also leaves copies it never reads (a tied weight under the other stage's
    name, possibly inside a module the stage calls): those are not used."""
    graph = getattr(stage_module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return {prefix + n for n, _ in stage_module.named_parameters()}
    used = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            used.add(prefix + node.target)
        elif node.op == "call_module":
            used |= used_parameters(stage_module.get_submodule(node.target), f"{prefix}{node.target}.")
    return used


def check_one_copy_per_stage(stage_module: nn.Module, stage: int, aliases: list[list[str]]) -> None:
    """A stage must read one weight of the model through ONE Parameter: pipelining's split can give a
    further use its own copy, which it records as no tie (its name follows export's choice), and whose
    gradient nothing would sum with the others."""
    used = used_parameters(stage_module)
    for names in aliases:
        copies = sorted(used & set(names))
        if len(copies) > 1:
            raise TieMismatch(
                f"stage {stage} reads one weight of the model (named {', '.join(names)}) through "
                f"{len(copies)} separate copies after the pipeline split ({', '.join(copies)}): the split "
                "gave one of its uses a copy of its own that no tie records, so the copies would get "
                "different gradients and drift apart. Choose split points that put all but one of the "
                "weight's uses on one side per stage (e.g. the embedding and any reuse on the first stage "
                "only, the head on the last), or untie it.")
