"""A pipeline step's length from each stage's F, B and W times and the schedule's own per-rank action order.

    simulate_step(schedule, pp, v, m, forward, backward_input, backward_weight, p2p_s=0.0) -> Simulated

Each rank runs its actions in the order torch's schedule gives it (`rank_actions`, `schedule_order`), one at a
time; an action starts once its rank is free and what it reads is there: F(s, i) after F(s - 1, i); the inputs'
gradient B(s, i) after F(s, i) and B(s + 1, i) (the last stage's after its own F, the loss inside it); the
weights' W(s, i) after B(s, i). An activation or gradient crossing to another rank arrives `p2p_s` later. A
schedule that does not split the backward runs B and W as one action. Nothing else is modelled (no
collectives, no host time): what it is for is comparing cuts of one model under one schedule, as
`gradsched.training.stage_balance` does.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradsched.training.pipeline_schedule import CUT_BACKWARD, MULTI_STAGE, rank_actions, schedule_order, \
    stage_assignment
from gradsched.training.virtual_stages import stage_ranks


@dataclass(frozen=True)
class Simulated:
    step_s: float  # from the first action's start to the last action's end
    busy_s: tuple[float, ...]  # each rank's time computing

    @property
    def bubble(self) -> float:
        """The share of the ranks' time idle: 1 - busy / (ranks x step)."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s) if self.step_s > 0 else 0.0


def actions(schedule: str, pp: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's (kind, stage, micro-batch) in run order: "F", "B" (the inputs' gradient, or the whole backward
    where the schedule does not split it), "W", "BW" (a whole backward under a splitting schedule)."""
    if schedule in MULTI_STAGE:
        return [rank_actions(schedule, r, pp, v, m) for r in range(pp)]
    if v != 1:
        raise ValueError(f"{schedule} runs one stage a rank, not {v}.")
    return [[(kind, r, i) for kind, i in schedule_order(r, pp, m, schedule)] for r in range(pp)]


def simulate_step(schedule: str, pp: int, v: int, m: int, forward, backward_input, backward_weight,
                  p2p_s: float = 0.0) -> Simulated:
    """The step of `schedule` (resolved: not "auto") over pp ranks of v stages each and m micro-batches; the three
    lists hold each stage's seconds per micro-batch. ValueError when the order deadlocks (it cannot, for torch's
    schedules: a failure here is a bug)."""
    n = pp * v
    if not len(forward) == len(backward_input) == len(backward_weight) == n:
        raise ValueError(f"simulate_step: {n} stages need {n} times each, got {len(forward)}, {len(backward_input)}, "
                         f"{len(backward_weight)}.")
    _, style = stage_assignment(schedule, v if v > 1 else None)
    owner = stage_ranks(pp, v, style)
    split = schedule in CUT_BACKWARD
    duration = {"F": forward, "B": backward_input if split else [b + w for b, w in zip(backward_input, backward_weight)],
                "W": backward_weight, "BW": [b + w for b, w in zip(backward_input, backward_weight)]}
    order = actions(schedule, pp, v, m)
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B" | "W", stage, micro-batch) -> its end
    free, nxt, busy = [0.0] * pp, [0] * pp, [0.0] * pp

    def arrival(kind: str, s: int, i: int, reader: int):
        end = done.get((kind, s, i))
        return None if end is None else end + (p2p_s if owner[s] != reader else 0.0)

    def ready_at(kind: str, s: int, i: int, rank: int):
        if kind == "F":
            needs = [("F", s - 1, i)] if s > 0 else []
        elif kind in ("B", "BW"):
            needs = [("F", s, i)] + ([("B", s + 1, i)] if s < n - 1 else [])
        else:
            needs = [("B", s, i)]
        times = [arrival(k, t, j, rank) for k, t, j in needs]
        return None if any(t is None for t in times) else max(times, default=0.0)

    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for r in range(pp):
            while nxt[r] < len(order[r]):
                kind, s, i = order[r][nxt[r]]
                at = ready_at(kind, s, i, r)
                if at is None:
                    break
                end = max(at, free[r]) + duration[kind][s]
                busy[r] += duration[kind][s]
                free[r] = end
                for k in (("B", "W") if kind == "BW" else (kind,)):
                    done[(k, s, i)] = end
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[r][nxt[r]] for r in range(pp) if nxt[r] < len(order[r])}
            raise ValueError(f"simulate_step: {schedule} at pp {pp} x {v}, {m} micro-batches deadlocks at {stuck}.")
    return Simulated(max(free), tuple(busy))
