"""Non-finite values are never applied: found before the optimizer steps, on every rank together.

During a step each rank notes on the device, never reading it, whether what it produced went non-finite:
its stage's forward output (what it sends on), its loss, its stage's input gradients (what it sends back)
and, at the step's end, its reduced gradients. One all-reduce over every rank of the plan carries these
flags (SLOTS numbers a rank; clip_grad_norm_ puts its partial norm in front, so the two share one
reduction), and one host read in the optimizer's step decides, the same on every rank: raise
NonFiniteError naming where the values first went non-finite (on_nonfinite="raise"), or skip the step
and leave the optimizer's state untouched ("skip").

Where first: activations flow forward and gradients backward, so the origin is the lowest stage whose
forward output went non-finite; else a rank whose loss did; else the highest stage whose input
gradients did; else the ranks whose reduced gradients did (their own parameters' gradients).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from gradsched.sync import agreement
from gradsched.sync.stage_setup import process_group
from gradsched.sync.watchdog import JOURNAL

FORWARD, LOSS, BACKWARD, GRADS = 1, 2, 3, 4  # a rank's slots; slot 0 holds its stage + 1
SLOTS = 5
WHAT = {FORWARD: "its stage's forward output (the activations it sends to the next stage)",
        LOSS: "its loss", BACKWARD: "its stage's input gradients (what it sends to the previous stage)",
        GRADS: "its reduced gradients"}


class NonFiniteError(RuntimeError):
    """A step's loss or gradients went non-finite on some rank: nothing was applied."""


class StepFlags:
    """This rank's observations during one step, on the device (no host read)."""

    def __init__(self):
        self.flags: torch.Tensor | None = None  # [2, SLOTS - 1] float64, the largest and the smallest element seen
        #                                        per kind: non-finite where that kind went so
        self.slots: list = []  # per kind, (largest, smallest) as 1-element views of flags
        self.agreed: torch.Tensor | None = None  # [world, SLOTS] after the step's reduction
        self.step = 0
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        """Nothing computed inside is a value of the model's (pipelining's shape inference on empty tensors)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def observe(self, kind: int, tensors) -> None:
        # no torch.no_grad() around it: its enter and exit cost twice the ops below; detach() keeps them off the tape
        if self._paused:
            return
        leaves = (tensors,) if isinstance(tensors, torch.Tensor) else torch.utils._pytree.tree_leaves(tensors)
        ts = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta and t.numel()]
        if not ts:
            return
        # the largest and the smallest element seen, per kind: one of them is non-finite exactly when some element
        # was (NaN propagates through max and min, neither can overflow); one fused pass a tensor (aminmax: 25x
        # faster than an inf-norm on a CPU), no temporary copy, maxed and mined into the step's slots: tested once
        # a step (bad), never read here
        high, low = self._slots(ts[0].device)[kind - 1]
        for t in ts:
            least, most = torch.aminmax(t.detach())
            torch.maximum(high, most, out=high)
            torch.minimum(low, least, out=low)

    def bad(self, device) -> torch.Tensor:
        """[SLOTS - 1] float64: 1 where that kind went non-finite this step, else 0."""
        return (~torch.isfinite(self._flags(device))).any(0).to(torch.float64)

    def _flags(self, device) -> torch.Tensor:
        if self.flags is None:
            self.flags = torch.zeros(2, SLOTS - 1, dtype=torch.float64, device=device)
            # each kind's (largest, smallest) slot as 1-element views, made once a step (two ops an observation)
            self.slots = list(zip(self.flags[0].split(1), self.flags[1].split(1)))
        return self.flags

    def _slots(self, device) -> list:
        self._flags(device)
        return self.slots

    def reset(self) -> None:
        self.flags, self.agreed = None, None


def local_vector(sync, grads_bad: torch.Tensor | None, device) -> torch.Tensor:
    """[world * SLOTS] zeros but this rank's row: its stage + 1 and its flags (grads_bad: its reduced
    gradients' flag, when the caller computed it already, e.g. from a partial norm)."""
    setup, flags = sync.setup, sync.nonfinite
    if grads_bad is None:
        grads_bad = reduced_gradients_bad(sync, device)
    row = torch.cat([torch.full((1,), setup.stage + 1.0, dtype=torch.float64, device=device), flags.bad(device)])
    row[GRADS] = torch.maximum(row[GRADS], grads_bad.to(torch.float64))
    out = torch.zeros(len(setup.all_ranks.ranks), SLOTS, dtype=torch.float64, device=device)
    out[setup.all_ranks.index] = row
    return out.reshape(-1)


@torch.no_grad()
def reduced_gradients_bad(sync, device) -> torch.Tensor:
    plan = sync.sync_plan
    grads = sync.reduced() if plan.shard else [p.grad for p in sync.params.values() if p.grad is not None]
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    # one pass a gradient, its smallest and largest elements (one non-finite exactly when an element is; an
    # inf-norm took 13 ms for 4M floats on a CPU core, aminmax 0.5), then one test, in float64: a float64
    # gradient's finite extremes may not fit a float32
    extremes = [x.double() for g in grads for x in torch.aminmax(g)]
    return (~torch.isfinite(torch.stack(extremes))).any().to(torch.float64)


def agree(sync, prefix: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "the step's non-finite flags",
          grads_bad: torch.Tensor | None = None) -> torch.Tensor:
    """All-reduce `prefix` (e.g. clip_grad_norm_'s partial norm) with every rank's flags over every rank of
    the plan, in one collective; keep the flags for the optimizer's step and return the reduced prefix.
    `op` is the prefix's (SUM or MAX); every rank's row has one writer, so either leaves the flags whole."""
    setup = sync.setup
    vec = torch.cat([prefix.reshape(-1).to(torch.float64), local_vector(sync, grads_bad, prefix.device)])
    if len(setup.all_ranks.ranks) > 1:
        pg = process_group(setup.all_ranks)
        with JOURNAL.entry(what, "collective", pg, "all_reduce", vec.numel(), vec.dtype):
            dist.all_reduce(vec, op=op, group=pg)
    n = prefix.numel()
    sync.nonfinite.agreed = vec[n:].reshape(len(setup.all_ranks.ranks), SLOTS)
    return vec[:n].reshape(prefix.shape)


def check(sync, on_nonfinite: str) -> bool:
    """Before the optimizer applies this step: True to apply it, False to skip it (on_nonfinite="skip"), or
    NonFiniteError (on_nonfinite="raise"); the same answer on every rank. One host read a step."""
    flags = sync.nonfinite
    flags.step += 1
    if flags.agreed is None:  # no clipping this step: the flags' own reduction
        device = next(iter(sync.params.values())).device
        agree(sync, torch.zeros(0, dtype=torch.float64, device=device))
    agreed = flags.agreed
    flags.reset()
    if agreed.is_meta:  # the dry run (gradsched.dryrun): the reduction is priced, no value is read
        return True
    bad = bool((agreed[:, 1:] > 0).any())  # the step's one host read of a device value
    agreement.settle(wait=True)  # the device is drained now: a mismatch of collectives explains any NaN first
    if not bad:
        return True
    if on_nonfinite == "skip":
        return False
    raise NonFiniteError(describe(agreed.cpu(), flags.step))


def describe(agreed: torch.Tensor, step: int) -> str:
    """Where the values went non-finite first (see the module's docstring), from every rank's row."""
    rows = {r: (int(agreed[r, 0]) - 1, {k for k in range(1, SLOTS) if agreed[r, k] > 0}) for r in range(len(agreed))}
    bad = {r: (s, kinds) for r, (s, kinds) in rows.items() if kinds}
    origin = None
    for kind, key in ((FORWARD, lambda r: (bad[r][0], r)), (LOSS, lambda r: r),
                      (BACKWARD, lambda r: (-bad[r][0], r)), (GRADS, lambda r: r)):
        hit = sorted((r for r in bad if kind in bad[r][1]), key=key)
        if hit:
            origin = (hit[0], kind)
            break
    r, kind = origin
    others = sorted(bad)
    return (f"step {step} (of this run): rank {r} (pipeline stage {bad[r][0]}) went non-finite first, in "
            f"{WHAT[kind]}; non-finite values were seen on rank(s) {others}. Nothing was applied: the optimizer did not step. "
            "Look for a division by zero, a log of zero, an overflow in low precision or bad input data on that "
            "rank (a global batch whose targets are all ignore_index has no mean loss either); SyncOptions(on_nonfinite='skip') skips such steps instead of ending the run.")
