"""Non-finite values are never applied: found before the optimizer steps, on every rank together.

During a step each rank notes on the device, never reading it, whether what it produced went non-finite:
its stage's forward output (what it sends on), its loss, its stage's input gradients (what it sends back)
and, at the step's end, its reduced gradients. One all-gather over every rank of the plan carries every
rank's row of SLOTS numbers at the step's end (ParallelModel.train_step's; clip_grad_norm_ puts its partial
norm in front when none ran); where every rank's reduced gradients are alike (`reduced_alike`: pp 1,
shard=False; or sharded buckets that spread a non-finite element before the reduction) it is issued before the
last backward instead, and each rank's own reduced-gradient marker is every rank's. The last stage's ranks add their loss's labelled count and share to their rows
(a non-finite share is a non-finite loss: no flag of its own is set), so the step's loss and the global count
need no collective of their own (gradsched.training.loss_weights). A flag is NaN where set, so the sum of every
row, the step's loss (and the own marker, `reduced_alike`) is finite exactly when nothing went non-finite: one
host read of it in the optimizer's step decides, the same on every rank: raise NonFiniteError naming where the values first went non-finite
(on_nonfinite="raise"), or skip the step and leave the optimizer's state untouched ("skip").

Where first: activations flow forward and gradients backward, so the origin is the lowest stage whose
forward output went non-finite; else a rank whose loss did; else the highest stage whose input
gradients did; else the ranks whose reduced gradients did (their own parameters' gradients). Before all of them:
a rank that received a non-finite activation over a pipeline boundary from a rank whose own forward output was
finite is named with that boundary, its sender and the micro-batch, so corruption in transit is told apart from
the model's own overflow.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsched.sync import agreement_check
from gradsched.sync.param_shards import all_gather
from gradsched.sync.stage_setup import process_group
from gradsched.sync.watchdog import JOURNAL

FORWARD, LOSS, BACKWARD, GRADS = 1, 2, 3, 4  # a rank's slots; slot 0 holds its stage + 1
KINDS = (FORWARD, LOSS, BACKWARD, GRADS)
COUNT, SHARE, SCALE = 5, 6, 7  # a rank's loss (the last stage's): labelled count, share, scale (training.loss_weights)
RECEIVED, RECEIVED_AT = 8, 9  # a rank's received activations: NaN where one went non-finite; the first such
#                               receipt's `transit_code` (lowest stage, then micro-batch), -1 for none
SLOTS = 10
TRANSIT = 2 ** 20  # `transit_code`'s radix: micro-batches and ranks below it, the code exact in float64
WHAT = {FORWARD: "its stage's forward output (the activations it sends to the next stage)",
        LOSS: "its loss", BACKWARD: "its stage's input gradients (what it sends to the previous stage)",
        GRADS: "its reduced gradients"}


def transit_code(stage: int, microbatch: int, sender: int) -> int:
    """One number for a receipt: stage `stage` got micro-batch `microbatch` from plan rank `sender`."""
    return (stage * TRANSIT + microbatch) * TRANSIT + sender


def transit_of(code: int) -> tuple[int, int, int]:
    """(stage, micro-batch, sender) of a `transit_code`."""
    rest, sender = divmod(code, TRANSIT)
    return (*divmod(rest, TRANSIT), sender)


class NonFiniteError(RuntimeError):
    """A step's loss or gradients went non-finite on some rank: nothing was applied."""


class StepFlags:
    """This rank's observations during one step, on the device (no host read)."""

    def __init__(self):
        self.seen: list[list] = [[] for _ in KINDS]  # per kind, the smallest and largest element of each tensor
        #                                            observed: non-finite where that kind went so
        self.loss_row: torch.Tensor | None = None  # [3] float64: this rank's COUNT, SHARE and SCALE, if it has a loss
        self.loss: torch.Tensor | None = None  # the step's loss, from every rank's row (ParallelModel.train_step)
        self.agreed: torch.Tensor | None = None  # [world, SLOTS] after the step's reduction
        self.own_grads: torch.Tensor | None = None  # issued early: this rank's reduced gradients' marker, every rank's
        self.received: list[tuple[int, list]] = []  # per activation received: its transit_code, its extremes
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
        # no torch.no_grad() around it: its enter and exit cost more than the op below; detach() keeps it off the tape
        if self._paused:
            return
        if isinstance(tensors, torch.Tensor):
            leaves = (tensors,)
        elif isinstance(tensors, tuple) and all(t is None or isinstance(t, torch.Tensor) for t in tensors):
            leaves = tensors  # a stage's input gradients: a flat tuple (no pytree walk a micro-batch)
        else:
            leaves = torch.utils._pytree.tree_leaves(tensors)
        seen = self.seen[kind - 1]
        # the smallest and the largest element: one of them is non-finite exactly when some element was (NaN
        # propagates through min and max, neither can overflow); one fused pass a tensor (aminmax: 25x faster than
        # an inf-norm on a CPU) and one op a micro-batch, tested once a step (bad), never read here
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta and t.numel():
                seen.extend(torch.aminmax(t.detach() if t.requires_grad else t))

    def observe_received(self, code: int, tensors) -> None:
        """Activations received over a pipeline boundary (`transit_code` says from where), before the stage
        computes on them."""
        if self._paused:
            return
        extremes = [v for t in torch.utils._pytree.tree_leaves(tensors)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta and t.numel()
                    for v in torch.aminmax(t.detach() if t.requires_grad else t)]
        if extremes:
            self.received.append((code, extremes))

    def observed(self) -> bool:
        return any(self.seen) or bool(self.received)

    def received_row(self, device) -> torch.Tensor:
        """[2] float64: RECEIVED's flag (NaN where a received activation went non-finite, else 0) and
        RECEIVED_AT (the first such receipt's code, else -1), on the device, unread."""
        if not self.received:
            return torch.tensor([0.0, -1.0], dtype=torch.float64, device=device)
        flags = torch.stack([(torch.stack(v).to(torch.float64) * 0).sum() for _, v in self.received])
        codes = torch.tensor([c for c, _ in self.received], dtype=torch.float64, device=device)
        first = torch.where(torch.isnan(flags), codes, torch.inf).amin()
        return torch.stack([flags.sum(), torch.where(torch.isinf(first), -1.0, first)])

    def bad(self, device) -> torch.Tensor:
        """[len(KINDS)]: NaN where that kind went non-finite this step, else 0 (a flag is its nonzero)."""
        none = torch.zeros((), device=device)
        # each kind's extremes times zero, summed: 0, or NaN where one was not finite (no sum of values: the
        # largest finite ones would overflow); their dtypes promoted by stack
        return torch.stack([(torch.stack(seen) * 0).sum() if seen else none for seen in self.seen])

    def reset(self) -> None:
        self.seen = [[] for _ in KINDS]
        self.received = []
        self.agreed, self.loss_row, self.loss, self.own_grads = None, None, None, None


def local_row(sync, grads_marker: torch.Tensor | None, device) -> torch.Tensor:
    """[SLOTS] float64, this rank's row: its stage + 1, its flags (NaN where a kind went non-finite, else 0) and
    its loss row. grads_marker: a value finite exactly when its reduced gradients are, when the caller computed
    one already (e.g. its partial norm); else computed here."""
    setup, flags = sync.setup, sync.nonfinite
    if grads_marker is None:
        grads_marker = reduced_gradients_marker(sync, device)
    loss = flags.loss_row if flags.loss_row is not None else torch.zeros(3, dtype=torch.float64, device=device)
    # nothing observed (a rank of one stage: its loss is checked through its share): no flags to make
    kinds = flags.bad(device)[:GRADS - 1] if flags.observed() else torch.zeros(GRADS - 1, device=device)
    return torch.cat([torch.full((1,), setup.stage + 1.0, dtype=torch.float64, device=device), kinds,
                      (grads_marker.to(torch.float64) * 0).reshape(1), loss.to(device), flags.received_row(device)])


@torch.no_grad()
def reduced_gradients_marker(sync, device) -> torch.Tensor:
    """A float64 scalar, finite exactly when every element of this rank's reduced gradients is."""
    plan = sync.sync_plan
    grads = sync.reduced()  # shards, or whole buckets (shard=False): a few tensors, not one a parameter
    if len(grads) != len(plan.layout.buckets):
        grads = [p.grad for p in sync.params.values() if p.grad is not None]
    return marker_of(grads, device)


def marker_of(grads: list, device) -> torch.Tensor:
    """A float64 scalar on `device`, finite exactly when every element of `grads` is (0 for none): one pass a
    tensor (an inf-norm took 13 ms for 4M floats on a CPU core, aminmax 0.5)."""
    values = [v for g in grads if g.numel() for v in _finite_iff_elements_are(g)]
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    return values[0] if len(values) == 1 else (torch.stack(values) * 0).sum()


def _finite_iff_elements_are(g: torch.Tensor) -> tuple:
    """float64 values, all finite exactly when every element of `g` is: its smallest and largest element (NaN
    propagates through min and max, and neither can overflow, in any dtype). One vectorised pass: a float64 sum of
    15M float32 gradients took 86 ms on a CPU core, their aminmax 4.2 (a pipeline stage's step tail, every step)."""
    return tuple(v.to(torch.float64) for v in torch.aminmax(g))


def agree(sync, prefix: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "the step's non-finite flags",
          grads_marker: torch.Tensor | None = None) -> torch.Tensor:
    """`prefix` (e.g. clip_grad_norm_'s partial norm) reduced by `op` (SUM or MAX) over every rank of the plan,
    with every rank's flags beside it unless this step's are agreed already (`agree_step`), in one collective."""
    if sync.nonfinite.agreed is not None:  # ParallelModel.train_step agreed them at its end: the prefix alone
        return _combine(_gathered(sync, prefix.reshape(-1).to(torch.float64), what), op).reshape(prefix.shape)
    return agree_step(sync, prefix, op, what, grads_marker)


def agree_step(sync, prefix: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "the step's non-finite flags",
               grads_marker: torch.Tensor | None = None) -> torch.Tensor:
    """`agree` with this rank's flags (and loss row) always: keeps every rank's row for the optimizer's step."""
    n = prefix.numel()
    row = local_row(sync, grads_marker, prefix.device)
    rows = _gathered(sync, torch.cat([prefix.reshape(-1).to(torch.float64), row]) if n else row, what)
    sync.nonfinite.agreed = rows[:, n:]
    return _combine(rows[:, :n], op).reshape(prefix.shape) if n else prefix  # the step's end: the row alone


def reduced_alike(sync) -> bool:
    """Every rank of the plan ends the step with reduced gradients that are finite alike, so each rank's own
    reduced-gradient flag is every rank's and the row needs no reduced gradient to be gathered. Over a gradient
    group that is every rank (pp 1): whole buckets all-reduced (shard=False: an all-reduce leaves the same values on
    every rank; gloo's and NCCL's reduce each element once and pass it on, and DDP's replicas rely on it too), or
    sharded buckets that spread a non-finite element over the whole bucket before the reduction
    (SyncPlan.spread_nonfinite: every rank's shard of it is NaN; known once the backward graph is built)."""
    if set(sync.setup.grad_group.ranks) != set(sync.setup.all_ranks.ranks):
        return False
    plan = sync.sync_plan
    return not sync.options.shard or (plan is not None and plan.spread_nonfinite)


@dataclass
class Issued:
    """The step's row gather, issued before the last backward (`issue_step`), not yet waited for."""
    out: torch.Tensor  # [world, SLOTS] once waited for
    work: object  # the all-gather's Work; None in a world of one
    what: str


def issue_step(sync, what: str, device) -> Issued:
    """`agree_step`'s gather with no prefix, issued now, asynchronously, when this rank's row is final but for
    its reduced gradients' flag and `reduced_alike` holds (pp 1, shard=False: after the last forward): its
    round trip then hides behind the last backward (on a first step, before any backward graph was compiled).
    GlobalLoss.end waits for it (`wait_issued`) and adds the flag."""
    row = local_row(sync, torch.zeros((), dtype=torch.float64, device=device), device)  # its own flag: later
    out, work = _gather(sync, row, f"{what}: issued before the last backward", async_op=True)
    return Issued(out, work, what)


def wait_issued(sync, issued: Issued) -> torch.Tensor:
    """`issue_step`'s gathered rows, waited for."""
    if issued.work is not None:
        with JOURNAL.entry(issued.what, "collective", process_group(sync.setup.all_ranks), "all_gather",
                           issued.out.numel(), issued.out.dtype):
            issued.work.wait()
    return issued.out


def finish_step(sync, rows: torch.Tensor) -> None:
    """After `wait_issued`, where this step's reduced buckets are not all there (a rank's gradients read where
    they lie, not reduced ones: they may differ between ranks): the ranks agree on a flag of them, kept beside the
    rows (`check` adds it). With every bucket reduced, GlobalLoss.end makes the rank's own flag instead
    (global_loss.end_arithmetic): every rank's is alike (`reduced_alike`)."""
    own = reduced_gradients_marker(sync, rows.device)
    own = _gathered(sync, (own * 0).reshape(1), "the step's reduced-gradient flags").sum()
    sync.nonfinite.agreed, sync.nonfinite.own_grads = rows, own


def _gathered(sync, row: torch.Tensor, what: str) -> torch.Tensor:
    """[world, len(row)]: every rank's `row`, in rank order. An all-gather: every rank reads every row (the
    non-finite origin's search needs them), and for a few numbers gloo's all-gather took a quarter of its
    all-reduce's time (0.32 against 1.37 ms between two processes here)."""
    return _gather(sync, row, what)[0]


def _gather(sync, row: torch.Tensor, what: str, async_op: bool = False) -> tuple[torch.Tensor, object]:
    """([world, len(row)], the all-gather's Work when async_op, else None): filled once it has completed."""
    world = len(sync.setup.all_ranks.ranks)
    if world == 1:
        return row.reshape(1, -1), None
    out = row.new_empty(world, row.numel())
    pg = process_group(sync.setup.all_ranks)
    with JOURNAL.entry(what, "collective", pg, "all_gather", out.numel(), out.dtype):
        work = all_gather(out.view(-1), row, pg, async_op=async_op)
    return out, work


def _combine(rows: torch.Tensor, op) -> torch.Tensor:
    """The gathered prefixes reduced in rank order, the same on every rank."""
    return rows.amax(0) if op == dist.ReduceOp.MAX else rows.sum(0)


def check(sync, on_nonfinite: str) -> bool:
    """Before the optimizer applies this step: True to apply it, False to skip it (on_nonfinite="skip"), or
    NonFiniteError (on_nonfinite="raise"); the same answer on every rank. One host read a step."""
    flags = sync.nonfinite
    flags.step += 1
    if flags.agreed is None:  # no train_step (the backend by name) and no clipping: the flags gathered here
        device = next(iter(sync.params.values())).device
        agree_step(sync, torch.zeros(0, dtype=torch.float64, device=device))
    agreed, loss, own = flags.agreed, flags.loss, flags.own_grads
    flags.reset()
    if agreed.is_meta:  # the dry run (gradsched.dryrun): the reduction is priced, no value is read
        return True
    # one number, finite exactly when the step is: every row's flags (NaN where set), counts, loss shares and
    # scales (finite unless its loss went bad), the step's loss (NaN too when the global batch has no label)
    # and, where every rank's reduced gradients are alike, this rank's own marker of them
    verdict = agreed.sum()
    if loss is not None:
        verdict = verdict + loss
    if own is not None:
        verdict = verdict + own
    mismatch = agreement_check.take_step_flag(verdict.device)  # NaN where the ranks' collectives differed
    if mismatch is not None:
        verdict = verdict + mismatch
    bad = not bool(torch.isfinite(verdict))  # the step's one host read of a device value
    if not bad:
        agreement_check.forget()  # every digest agreed: their host copies need no reading
        return True
    agreement_check.settle(wait=True)  # the device is drained now: a mismatch of collectives explains any NaN first
    if on_nonfinite == "skip":
        return False
    if own is not None:  # every rank's reduced gradients are this rank's (reduced_alike)
        agreed = agreed.clone()
        agreed[:, GRADS] += own * 0
    raise NonFiniteError(describe(agreed.cpu(), flags.step, loss is not None and not bool(torch.isfinite(loss))))


def describe(agreed: torch.Tensor, step: int, loss_bad: bool = False) -> str:
    """Where the values went non-finite first (see the module's docstring), from every rank's row. `loss_bad`: the
    step's loss went non-finite; where no rank's own loss share did (a global batch without a labelled token:
    0/0), the last stage's ranks are named for it."""
    # a rank's loss went non-finite where its share did (the loss is checked through it, not flagged)
    rows = {r: (int(agreed[r, 0]) - 1, {k for k in KINDS if agreed[r, k] != 0} |
                ({LOSS} if not torch.isfinite(agreed[r, SHARE]) else set())) for r in range(len(agreed))}
    if loss_bad and not any(LOSS in kinds for _, kinds in rows.values()):
        last = max(s for s, _ in rows.values())
        rows = {r: (s, kinds | ({LOSS} if s == last else set())) for r, (s, kinds) in rows.items()}
    bad = {r: (s, kinds) for r, (s, kinds) in rows.items() if kinds}
    transit = sorted((int(agreed[r, RECEIVED_AT]), r) for r in range(len(agreed)) if agreed[r, RECEIVED] != 0)
    upstream = min((s for s, kinds in bad.values() if FORWARD in kinds), default=None)  # the model's own
    for code, r in transit:
        stage, microbatch, sender = transit_of(code)
        # its sender's own output was finite, and no stage before went non-finite: it changed on the way
        if agreed[sender, FORWARD] == 0 and (upstream is None or upstream >= stage):
            others = sorted(set(bad) | {q for _, q in transit})
            return (f"step {step} (of this run): rank {r} received a non-finite activation from rank {sender} "
                    f"(stage {stage - 1} -> {stage}, micro-batch {microbatch}) whose own output was finite; "
                    f"non-finite values were seen on rank(s) {others}. Nothing was applied: the optimizer did not "
                    "step. The values changed between the two ranks: look at the link, the transport (its "
                    "buffers, a driver or NCCL fault) or a write into the sent tensor after it was computed, not "
                    "at the model.")
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
