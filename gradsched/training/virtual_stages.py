"""Several pipeline stages a rank: which stages a rank holds, its tied copies made one Parameter, and its stages
as one module under the model's own names.

The model is split into pp x v stages (v = stages_per_rank); the pipeline group's rank r holds
    "loop" (interleaved 1F1B, v >= 2)   stages r, r + pp, ..., r + (v - 1) pp
    "v"    (zbv, dualpipev, v = 2)      stages r and 2 pp - 1 - r: the first and the last stage (a GPT's
                                         embedding and its LM head) on rank 0
as torch.distributed.pipelining's schedules place them. A tie whose copies sit on one rank becomes one
Parameter there (`merge_local_ties`): autograd sums its stages' gradients into one .grad, with no collective;
the ties left span ranks, one copy a rank, and are summed over a tie group as at one stage a rank.
"""
from __future__ import annotations

import torch.nn as nn

from gradsched.sync.ties import Tie, used_parameters

def stage_ranks(pp: int, v: int, style: str) -> list[int]:
    """The pipeline rank holding each of the pp x v stages."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * v)]


def local_stages(rank: int, pp: int, v: int, style: str) -> list[int]:
    """The stages pipeline rank `rank` holds, in stage order."""
    return [s for s, r in enumerate(stage_ranks(pp, v, style)) if r == rank]


def merge_local_ties(modules: dict[int, nn.Module], ties: list[Tie], ranks: list[int]) -> tuple[list[Tie], list]:
    """`modules`: this rank's stage modules by stage; `ranks`: each stage's rank. Every tie's copies on this
    rank are made one Parameter (the first stage's), in place. Returns (the ties across ranks, each member
    (rank, name of its first copy there), the same list on every rank; the groups of names now one Parameter,
    the kept copy's name first)."""
    across, merged = [], []
    for tie in ties:
        by_rank: dict[int, list[tuple[int, str]]] = {}
        for stage, name in tie.members:
            by_rank.setdefault(ranks[stage], []).append((stage, name))
        for copies in by_rank.values():
            if len(copies) > 1 and copies[0][0] in modules:  # on this rank: the later copies become the first
                keep = modules[copies[0][0]].get_parameter(copies[0][1])
                for stage, name in copies[1:]:
                    set_parameter(modules[stage], name, keep)
                merged.append(list(dict.fromkeys(n for _, n in copies)))  # the kept copy's name first
        if len(by_rank) > 1:
            across.append(Tie(tuple(sorted((r, copies[0][1]) for r, copies in by_rank.items()))))
    return sorted(across, key=lambda t: t.key), merged


def set_parameter(module: nn.Module, name: str, p: nn.Parameter) -> None:
    parent, _, attr = name.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    owner._parameters[attr] = p


class RankStages(nn.Module):
    """This rank's stage modules' parameters and buffers under one root, each at its name in the unsplit model
    (the same tensors, not copies): what state dicts, checkpoints, parameter groups and the replicas' check read
    of the rank. It has no forward: each stage runs as its own module."""

    def __init__(self, stage_modules: list[nn.Module]):
        super().__init__()
        # not submodules (state dicts and parameters would name each tensor twice): what materialize allocates too
        self.__dict__["stage_modules"] = list(stage_modules)
        # a name the split left on several stages (a tied weight's stale copy on a stage that never reads it)
        # is the copy of the stage that reads it; the read ones first, in stage order (a Parameter under two
        # names is then named by its first stage's, as the rank's GradSync names it)
        read, unread = [], []
        for m in stage_modules:
            used = used_parameters(m)
            for name, t in m.named_parameters(remove_duplicate=False):
                (read if name in used else unread).append(("_parameters", name, t))
            read += [("_buffers", name, t) for name, t in m.named_buffers(remove_duplicate=False)]
        placed = set()
        for table, name, t in read + unread:
            if name not in placed:
                placed.add(name)
                parent, _, attr = name.rpartition(".")
                getattr(self._container(parent), table)[attr] = t

    def _container(self, path: str) -> nn.Module:
        module = self
        for part in path.split(".") if path else ():
            if part not in module._modules:
                module._modules[part] = nn.Module()
            module = module._modules[part]
        return module

    def forward(self, *args, **kwargs):
        raise RuntimeError("RankStages holds a rank's pipeline stages for their state; each stage runs on its own.")


def refuse_with_several_stages(options, plan) -> None:
    """What several stages a rank do not run yet, refused at parallelize (before any collective)."""
    if options.placement == "backward":  # no one backward graph holds a rank's gradients: they are reduced at the flush
        raise ValueError("several pipeline stages a rank (interleaved_1f1b, zbv, dualpipev, zb1p with "
                         "stages_per_rank > 1) do not run with placement='backward': use placement 'auto', "
                         "'tied_at_flush' or 'flush' (every bucket is reduced in the flush), or one stage a rank "
                         "(1f1b, gpipe, zb1p).")
