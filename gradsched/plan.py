"""The parallel plan: pipeline x data x context x tensor parallel sizes over torch.distributed.

Rank layout (tensor fastest, then context, then data, then pipeline), as Megatron does:

    rank = base + ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx

so a TP group's ranks are neighbours (inside a node, where its per-layer traffic belongs) and a
pipeline stage's dp x cp x tp ranks are contiguous. Every group is built here, by every rank, in
one fixed order (new_group is itself a collective).

Groups (each per TP index, except tp itself: every TP rank holds its own shard of the stage):
  grad   the ranks of one stage with this TP index (dp x cp): gradients are reduced over it.
  dp     same stage, cp and tp index.     cp   same stage, dp and tp index.
  pp     same dp, cp and tp index, one rank per stage (activations travel here).
  tp     same stage, dp and cp index: the ranks that split each layer's matrices.
  stage  every rank of one stage (dp x cp x tp; the grad group at tp 1): they start from one whole model,
         before each TP rank cuts its shards.
  tie    for a set of stages holding copies of one weight: the ranks of those
         stages with this rank's dp, cp and tp index. Derived from the ties found,
         never hand-listed.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch.distributed as dist


DIMENSIONS = ("pp", "dp", "cp", "tp")  # in coords' order: pipeline slowest, tensor fastest


class PlanError(ValueError):
    """A plan that cannot be laid over the processes at hand."""


@dataclass
class ParallelPlan:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    group: dist.ProcessGroup | None = None  # None: the default (world) group
    _groups: dict = field(default_factory=dict, repr=False)
    _tie_groups: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_world(cls, pp: int = 1, cp: int = 1, dp: int | None = None, tp: int = 1,
                   group: dist.ProcessGroup | None = None) -> "ParallelPlan":
        """Lay the plan over `group` (default: the world), inferring dp if omitted.

        Starts the default process group from torchrun's environment (RANK,
        WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when none is running yet; sizes that
        cannot fit WORLD_SIZE are refused before it connects (every rank alike).
        """
        if not dist.is_initialized():
            if group is None and os.environ.get("WORLD_SIZE", "").isdigit():
                plan_sizes(int(os.environ["WORLD_SIZE"]), pp, cp, dp, tp)  # a plan that cannot fit: before connecting
            init_from_env()
        world = dist.get_world_size(group)
        dp = plan_sizes(world, pp, cp, dp, tp)
        plan = cls(pp=pp, dp=dp, cp=cp, tp=tp, group=group)
        plan._build_groups()
        return plan

    # ---- coordinates -------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def rank(self) -> int:
        """This process's rank inside the plan (0 .. world-1)."""
        if self.world == 1 and not dist.is_initialized():
            return 0  # a one-process plan needs no process group until something is reduced
        return dist.get_rank(self.group)

    def coords(self, rank: int | None = None) -> tuple[int, int, int, int]:
        """(pp_idx, dp_idx, cp_idx, tp_idx) of a plan rank."""
        r = self.rank if rank is None else rank
        t, r = r % self.tp, r // self.tp
        return r // (self.dp * self.cp), (r // self.cp) % self.dp, r % self.cp, t

    def rank_of(self, pp_idx: int, dp_idx: int, cp_idx: int = 0, tp_idx: int = 0) -> int:
        return ((pp_idx * self.dp + dp_idx) * self.cp + cp_idx) * self.tp + tp_idx

    def index(self, kind: str, rank: int | None = None) -> int:
        """A plan rank's coordinate along one dimension ("pp", "dp", "cp" or "tp"): code that needs one asks by
        name, so a new dimension changes the layout here only."""
        return self.coords(rank)[DIMENSIONS.index(kind)]

    @property
    def stage_replicas(self) -> int:
        """How many ranks hold each TP shard of a pipeline stage (the gradient group's size)."""
        return self.dp * self.cp

    def first_replica(self, rank: int | None = None) -> int:
        """The plan rank holding the first replica of `rank`'s stage and TP shard (its values are every replica's)."""
        return self.rank_of(self.index("pp", rank), 0, 0, self.index("tp", rank))

    def global_rank(self, plan_rank: int) -> int:
        return plan_rank if self.group is None else dist.get_global_rank(self.group, plan_rank)

    @property
    def stage(self) -> int:
        return self.coords()[0]

    # ---- groups -----------------------------------------------------------------
    def _layouts(self):
        """Every group of every kind, as lists of plan ranks, in a fixed order."""
        P, D, C, T = self.pp, self.dp, self.cp, self.tp
        yield "grad", [[self.rank_of(p, d, c, t) for d in range(D) for c in range(C)] for p in range(P) for t in range(T)]
        yield "dp", [[self.rank_of(p, d, c, t) for d in range(D)] for p in range(P) for c in range(C) for t in range(T)]
        yield "cp", [[self.rank_of(p, d, c, t) for c in range(C)] for p in range(P) for d in range(D) for t in range(T)]
        yield "pp", [[self.rank_of(p, d, c, t) for p in range(P)] for d in range(D) for c in range(C) for t in range(T)]
        yield "tp", [[self.rank_of(p, d, c, t) for t in range(T)] for p in range(P) for d in range(D) for c in range(C)]
        if T > 1:  # at tp 1 a stage's ranks are its grad group
            yield "stage", [[self.rank_of(p, d, c, t) for d in range(D) for c in range(C) for t in range(T)]
                            for p in range(P)]

    def _build_groups(self) -> None:
        for kind, layouts in self._layouts():
            self._groups[kind] = self._subgroup(layouts)

    def _subgroup(self, layouts: list[list[int]]):
        """Create one group per layout (all ranks call this); return (ranks, pg) of ours."""
        mine = None
        for ranks in layouts:
            granks = [self.global_rank(r) for r in ranks]
            pg = dist.new_group(granks, use_local_synchronization=False)
            if self.rank in ranks:
                mine = (tuple(ranks), pg)
        return mine

    def _group(self, kind: str):
        if kind == "stage" and self.tp == 1:
            kind = "grad"
        if not self._groups:
            raise PlanError(f"{self} has no process groups: build plans with ParallelPlan.from_world(pp=..., "
                            "cp=...), which lays them over the running processes (a one-process run too, "
                            "started with torchrun --nproc-per-node 1).")
        return self._groups[kind]

    def process_group(self, kind: str) -> dist.ProcessGroup:
        return self._group(kind)[1]

    def group_ranks(self, kind: str) -> tuple[int, ...]:
        return self._group(kind)[0]

    def tie_group(self, stages: tuple[int, ...]) -> tuple[tuple[int, ...], dist.ProcessGroup] | None:
        """The group that sums a tied weight's copies held by `stages` (None on a rank of no such stage).

        Must be called by every rank for the same `stages`, in the same order:
        tie discovery is deterministic, so it is.
        """
        stages = tuple(sorted(set(stages)))
        if any(not 0 <= s < self.pp for s in stages):
            raise PlanError(f"tie across stages {stages}, but the plan has pp={self.pp}.")
        if stages not in self._tie_groups:
            layouts = [[self.rank_of(s, d, c, t) for s in stages]
                       for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]
            self._tie_groups[stages] = self._subgroup(layouts)
        return self._tie_groups[stages]

    def describe(self) -> str:
        p, d, c, t = self.coords()
        tp = f", tp={t}/{self.tp}" if self.tp > 1 else ""
        return f"rank {self.rank}/{self.world} (pp={p}/{self.pp}, dp={d}/{self.dp}, cp={c}/{self.cp}{tp})"


def plan_sizes(world: int, pp: int = 1, cp: int = 1, dp: int | None = None, tp: int = 1) -> int:
    """dp of a plan of pp x dp x cp x tp over `world` processes (inferred when None); a PlanError when the sizes
    cannot fit. Needs no process group: every rank decides alike from the same sizes, before connecting."""
    for name, size in (("pp", pp), ("cp", cp), ("tp", tp)):
        if size < 1:
            raise PlanError(f"{name}={size}: every parallel size must be >= 1.")
    others = pp * cp * tp
    named = f"pp={pp} x cp={cp}" + (f" x tp={tp}" if tp > 1 else "")
    if dp is None:
        if world % others:
            raise PlanError(
                f"{named} does not divide the world size {world}: "
                f"start a multiple of {others} processes, or change {'pp/cp/tp' if tp > 1 else 'pp/cp'}.")
        dp = world // others
    if dp < 1 or dp * others != world:
        sizes = f"pp={pp} x dp={dp} x cp={cp}" + (f" x tp={tp}" if tp > 1 else "")
        raise PlanError(
            f"{sizes} = {dp * others} processes, but the world has "
            f"{world}: choose sizes whose product is {world}, or leave dp out to infer it.")
    return dp


def init_from_env(backend: str | None = None, timeout_s: float = 120.0) -> None:
    """Start the default process group from torchrun's variables.

    A finite timeout turns a collective that some rank never reaches into an
    error instead of a silent hang.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise PlanError(
            f"torch.distributed is not initialized and {', '.join(missing)} is not set: "
            "launch with torchrun, or call torch.distributed.init_process_group first.")
    import torch
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU per process: torchrun's LOCAL_RANK says which
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
